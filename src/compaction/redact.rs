//! Strict secret redaction for everything the engine sends to a summariser or
//! writes into a summary (reference §3.8, §3.12): the summariser may run on a
//! different provider than the conversation, and a summary is replayed on
//! every later turn, so secrets are removed even when the user disabled
//! redaction elsewhere.

use regex::{Captures, Regex};
use std::borrow::Cow;
use std::sync::LazyLock;

/// Replacement text for a redacted secret.
pub const REDACTED: &str = "[REDACTED]";

struct Rules {
    private_key_block: Option<Regex>,
    private_key_open: Option<Regex>,
    url_credentials: Option<Regex>,
    bearer: Option<Regex>,
    auth_header: Option<Regex>,
    known_tokens: Option<Regex>,
    assignment: Option<Regex>,
}

// The patterns are constants covered by tests; a pattern that failed to
// compile would make its rule a no-op rather than take the proxy down.
static RULES: LazyLock<Rules> = LazyLock::new(|| {
    Rules {
    private_key_block: Regex::new(
        r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----[\s\S]*?-----END [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----",
    )
    .ok(),
    // A key block cut off before its END line (truncated paste or output).
    private_key_open: Regex::new(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----[\s\S]*").ok(),
    url_credentials: Regex::new(r"(?i)\b([a-z][a-z0-9+.\-]*://)[^\s/@:]+:[^\s/@]+@").ok(),
    bearer: Regex::new(r"(?i)\b(bearer)(\s+)[A-Za-z0-9._~+/=\-]{8,}").ok(),
    auth_header: Regex::new(r"(?i)\b(authorization\s*[:=]\s*[\x22']?)(basic|token|digest)(\s+)[A-Za-z0-9._~+/=\-]{6,}").ok(),
    known_tokens: Regex::new(concat!(
        r"\b(?:",
        r"sk-[A-Za-z0-9_\-]{16,}",              // OpenAI / Anthropic style
        r"|gh[pousr]_[A-Za-z0-9]{16,}",         // GitHub tokens
        r"|github_pat_[A-Za-z0-9_]{20,}",
        r"|glpat-[A-Za-z0-9_\-]{16,}",          // GitLab
        r"|xox[abposr]-[A-Za-z0-9\-]{10,}",     // Slack
        r"|AKIA[0-9A-Z]{16}",                   // AWS access key id
        r"|ASIA[0-9A-Z]{16}",
        r"|AIza[0-9A-Za-z_\-]{30,}",            // Google API key
        r"|hf_[A-Za-z0-9]{24,}",                // Hugging Face
        r"|npm_[A-Za-z0-9]{30,}",
        r"|pypi-[A-Za-z0-9_\-]{40,}",
        r"|(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{16,}", // Stripe
        r"|xai-[A-Za-z0-9]{20,}",
        r"|gsk_[A-Za-z0-9]{20,}",               // Groq
        r"|eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}", // JWT
        r")"
    ))
    .ok(),
    assignment: Regex::new(concat!(
        r"(?i)([A-Za-z0-9_.\-]*(?:api[_\-]?key|apikey|secret|token|passwd|password|passphrase|pwd",
        r"|access[_\-]?key|private[_\-]?key|credential|auth)[A-Za-z0-9_.\-]*)",
        r#"(["']?\s*[:=]\s*)(["']?)([^\s"',;&}\]]+)"#
    ))
    .ok(),
}
});

/// Redacts secrets in strict mode: private key blocks, credentials in URLs,
/// bearer/basic authorization values, well-known token formats (OpenAI,
/// GitHub `gh[pousr]_…`, GitLab, Slack, AWS, Google, Hugging Face, Stripe,
/// JWTs…) and the values of secret-looking assignments (`password=…`,
/// `"api_key": "…"`, `TOKEN: …`). Text without secrets comes back unchanged.
pub fn redact_secrets(text: &str) -> String {
    redact_cow(text).into_owned()
}

/// [`redact_secrets`] without a copy when nothing matched.
pub fn redact_cow(text: &str) -> Cow<'_, str> {
    let r = &*RULES;
    let mut out: Cow<'_, str> = Cow::Borrowed(text);
    if let Some(re) = &r.private_key_block {
        out = replace(out, re, |_| "[REDACTED PRIVATE KEY]".to_string());
    }
    if let Some(re) = &r.private_key_open {
        out = replace(out, re, |_| "[REDACTED PRIVATE KEY]".to_string());
    }
    if let Some(re) = &r.url_credentials {
        out = replace(out, re, |c| format!("{}{REDACTED}@", &c[1]));
    }
    if let Some(re) = &r.bearer {
        out = replace(out, re, |c| format!("{}{}{REDACTED}", &c[1], &c[2]));
    }
    if let Some(re) = &r.auth_header {
        out = replace(out, re, |c| {
            format!("{}{}{}{REDACTED}", &c[1], &c[2], &c[3])
        });
    }
    if let Some(re) = &r.known_tokens {
        out = replace(out, re, |_| REDACTED.to_string());
    }
    if let Some(re) = &r.assignment {
        out = replace(out, re, redact_assignment);
    }
    out
}

fn replace<'a>(
    text: Cow<'a, str>,
    re: &Regex,
    f: impl FnMut(&Captures<'_>) -> String,
) -> Cow<'a, str> {
    if !re.is_match(&text) {
        return text;
    }
    let replaced = re.replace_all(&text, f).into_owned();
    if replaced == *text {
        // Matches whose replacement kept them (non-secret assignments).
        return text;
    }
    Cow::Owned(replaced)
}

/// Decides whether the value of a secret-looking assignment is a secret.
/// Password-class keys always are; token/key-class keys only when the value
/// looks like a credential (long enough, not a plain number or keyword), so
/// `max_tokens: 4096` or `auth: true` survive.
fn redact_assignment(c: &Captures<'_>) -> String {
    let key = &c[1];
    let sep = &c[2];
    let quote = &c[3];
    let value = &c[4];
    let whole = c.get(0).map(|m| m.as_str()).unwrap_or_default();
    if value.contains(REDACTED) || value.starts_with('[') {
        return whole.to_string();
    }
    let lower = key.to_ascii_lowercase();
    let password_class = ["passwd", "password", "passphrase", "pwd", "secret"]
        .iter()
        .any(|k| lower.contains(k));
    let keyword = matches!(
        value.to_ascii_lowercase().as_str(),
        "true"
            | "false"
            | "null"
            | "none"
            | "nil"
            | "undefined"
            | "redacted"
            | "required"
            | "optional"
    );
    let numeric = value
        .chars()
        .all(|ch| ch.is_ascii_digit() || ch == '.' || ch == '-');
    let secretish = if password_class {
        !keyword && !value.is_empty()
    } else {
        !keyword && !numeric && value.len() >= 8
    };
    // Keys like `tokens`, `max_tokens` or `author` are counters and names, not credentials.
    let counter_like = lower.ends_with("tokens")
        || lower.ends_with("_count")
        || lower.contains("author")
        || lower.ends_with("token_limit");
    if secretish && !counter_like {
        format!("{key}{sep}{quote}{REDACTED}")
    } else {
        whole.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_patterns_compile() {
        let r = &*RULES;
        assert!(r.private_key_block.is_some());
        assert!(r.private_key_open.is_some());
        assert!(r.url_credentials.is_some());
        assert!(r.bearer.is_some());
        assert!(r.auth_header.is_some());
        assert!(r.known_tokens.is_some());
        assert!(r.assignment.is_some());
    }

    #[test]
    fn plain_text_unchanged() {
        let t = "Fix /tmp/project/app.py; max_tokens: 4096; the author is Ann; tokens: 500";
        assert_eq!(redact_secrets(t), t);
        assert!(matches!(redact_cow(t), Cow::Borrowed(_)));
    }

    #[test]
    fn api_keys() {
        let t = "key sk-proj-ABCDEFGHIJKLMNOPQRSTUVWX and sk-ant-api03-abcdefghijklmnopqrstu";
        let r = redact_secrets(t);
        assert!(!r.contains("ABCDEFGHIJKLMNOP"), "{r}");
        assert!(!r.contains("abcdefghijklmnop"), "{r}");
        assert_eq!(r.matches(REDACTED).count(), 2);
        let aws = redact_secrets("AKIAIOSFODNN7EXAMPLE");
        assert_eq!(aws, REDACTED);
    }

    #[test]
    fn github_tokens() {
        let secret = format!("ghp_{}", "a".repeat(36));
        let r = redact_secrets(&format!("never leak {secret} ok"));
        assert_eq!(r, format!("never leak {REDACTED} ok"));
        for p in ["gho_", "ghu_", "ghs_", "ghr_"] {
            let r = redact_secrets(&format!("{p}{}", "Z9".repeat(18)));
            assert!(!r.contains(p), "{r}");
        }
    }

    #[test]
    fn bearer_tokens() {
        let r = redact_secrets("Authorization: Bearer abc.def-ghi_jkl123456");
        assert_eq!(r, "Authorization: Bearer [REDACTED]");
        let r = redact_secrets("curl -H 'Authorization: Basic dXNlcjpwYXNz'");
        assert!(!r.contains("dXNlcjpwYXNz"), "{r}");
    }

    #[test]
    fn url_credentials() {
        let r = redact_secrets("clone https://bob:hunter2@example.com/repo.git now");
        assert_eq!(r, "clone https://[REDACTED]@example.com/repo.git now");
        let r = redact_secrets("postgres://admin:s3cr3t@db:5432/x");
        assert!(!r.contains("s3cr3t"), "{r}");
        assert!(r.contains("db:5432/x"));
    }

    #[test]
    fn passwords_and_assignments() {
        let r = redact_secrets("password=hunter2 user=bob");
        assert_eq!(r, "password=[REDACTED] user=bob");
        let r = redact_secrets(r#"{"api_key": "abcdef123456789", "n": 3}"#);
        assert_eq!(r, r#"{"api_key": "[REDACTED]", "n": 3}"#);
        let r = redact_secrets("export OPENAI_API_KEY=somethingsecret");
        assert_eq!(r, "export OPENAI_API_KEY=[REDACTED]");
        let r = redact_secrets("DB_PASSWORD: 'x'");
        assert!(!r.contains("'x'"), "{r}");
    }

    #[test]
    fn private_keys() {
        let t = "before\n-----BEGIN RSA PRIVATE KEY-----\nMIIEow\nabc\n-----END RSA PRIVATE KEY-----\nafter";
        let r = redact_secrets(t);
        assert_eq!(r, "before\n[REDACTED PRIVATE KEY]\nafter");
        let r = redact_secrets("x -----BEGIN OPENSSH PRIVATE KEY-----\nb3Blbn");
        assert!(!r.contains("b3Blbn"));
    }

    #[test]
    fn jwt() {
        let r = redact_secrets(
            "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N",
        );
        assert_eq!(r, REDACTED);
    }

    #[test]
    fn idempotent() {
        let t = "password=hunter2 Bearer abcdefghijkl https://u:p@h/x ghp_aaaaaaaaaaaaaaaaaaaaaaaa";
        let once = redact_secrets(t);
        assert_eq!(redact_secrets(&once), once);
    }
}
