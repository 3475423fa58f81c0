//! Strict secret redaction for everything the engine sends to a summariser or
//! writes into a summary: the summariser may run on a
//! different provider than the conversation, and a summary is replayed on
//! every later turn, so secrets are removed even when the user disabled
//! redaction elsewhere.

use regex::{Captures, Regex};
use std::borrow::Cow;
use std::sync::LazyLock;

/// Replacement text for a redacted secret.
pub(crate) const REDACTED: &str = "[REDACTED]";

struct Rules {
    private_key_block: Option<Regex>,
    private_key_open: Option<Regex>,
    url_credentials: Option<Regex>,
    bearer: Option<Regex>,
    auth_header: Option<Regex>,
    known_tokens: Option<Regex>,
    env_assign: Option<Regex>,
    quoted_field: Option<Regex>,
    password_assign: Option<Regex>,
    key_assign: Option<Regex>,
    cli_flag: Option<Regex>,
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
    // SHELL_STYLE / .env names: `OPENAI_API_KEY=…`, `GITHUB_TOKEN: …`.
    env_assign: Regex::new(concat!(
        r"\b(?P<k>[A-Z0-9_]*(?:API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|PWD|ACCESS_KEY|PRIVATE_KEY|CREDENTIALS?|AUTH)[A-Z0-9_]*)",
        r#"(?P<sep>\s*[=:]\s*["']?)(?P<v>[^\s"',;]+)(?P<end>)"#
    ))
    .ok(),
    // Quoted values of secret-named fields in JSON, YAML, TOML or code:
    // `"apiKey": "…"`, `token = '…'`.
    quoted_field: Regex::new(concat!(
        r#"(?i)(?P<k>["']?[A-Za-z0-9_.\-]*(?:api[_\-]?key|apikey|secret|token|passw(?:or)?d|passphrase|access[_\-]?key|private[_\-]?key|credential|auth)[A-Za-z0-9_.\-]*["']?)"#,
        r#"(?P<sep>\s*[:=]\s*["'])(?P<v>[^"'\r\n]+)(?P<end>["'])"#
    ))
    .ok(),
    // Unquoted password-class assignments in any case: `password=hunter2`.
    password_assign: Regex::new(concat!(
        r"(?i)\b(?P<k>[A-Za-z0-9_.\-]*(?:passw(?:or)?d|passphrase|pwd)[A-Za-z0-9_.\-]*)",
        r#"(?P<sep>\s*[:=]\s*)(?P<v>[^\s"',;]+)(?P<end>)"#
    ))
    .ok(),
    // Unquoted key-class assignments in any case (`api_key=…` in logs and
    // query strings). The character after the value is captured so calls
    // like `token = parse_token(x)` can be told apart.
    key_assign: Regex::new(concat!(
        r"(?i)\b(?P<k>[A-Za-z0-9_.\-]*(?:api[_\-]?key|apikey|access[_\-]?key|secret[_\-]?key|client[_\-]?secret|auth[_\-]?token|access[_\-]?token|refresh[_\-]?token|token|secret))",
        r"(?P<sep>\s*[:=]\s*)(?P<v>[A-Za-z0-9_\-./+=]{8,})(?P<end>[^A-Za-z0-9_\-./+=]?)"
    ))
    .ok(),
    // Command-line flags: `--api-key xyz`, `--password=xyz`, `--token xyz`.
    cli_flag: Regex::new(concat!(
        r"(?i)(?P<k>--(?:api[_\-]?key|token|auth[_\-]?token|password|passwd|secret|access[_\-]?key|client[_\-]?secret))",
        r#"(?P<sep>[= ]["']?)(?P<v>[^\s"']+)(?P<end>)"#
    ))
    .ok(),
    }
});

/// Redacts secrets in strict mode: private key blocks, credentials in URLs,
/// bearer/basic authorization values, well-known token formats (OpenAI,
/// GitHub `gh[pousr]_…`, GitLab, Slack, AWS, Google, Hugging Face, Stripe,
/// JWTs…) and the values of secret-looking assignments (`password=…`,
/// `"api_key": "…"`, `TOKEN: …`). Text without secrets comes back unchanged.
pub(super) fn redact_secrets(text: &str) -> String {
    redact_cow(text).into_owned()
}

/// [`redact_secrets`] without a copy when nothing matched.
pub(super) fn redact_cow(text: &str) -> Cow<'_, str> {
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
    for re in [
        &r.env_assign,
        &r.quoted_field,
        &r.password_assign,
        &r.key_assign,
        &r.cli_flag,
    ]
    .into_iter()
    .flatten()
    {
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
/// looks like a credential (6+ chars, not a plain number or keyword), so
/// `MAX_TOKENS=4096` or `"auth": "none"` survive.
fn redact_assignment(c: &Captures<'_>) -> String {
    let get = |name: &str| c.name(name).map_or("", |m| m.as_str());
    let (key, sep, value, end) = (get("k"), get("sep"), get("v"), get("end"));
    let whole = c.get(0).map_or("", |m| m.as_str());
    if value.contains(REDACTED) || value.starts_with('[') || end == "(" {
        return whole.to_string();
    }
    let lower = key.to_ascii_lowercase();
    let password_class = ["passw", "passphrase", "pwd"]
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
            | "string"
            | "str"
            | "bool"
            | "int"
            | "number"
            | "object"
            | "bearer"
            | "basic"
    );
    let numeric = value
        .chars()
        .all(|ch| ch.is_ascii_digit() || ch == '.' || ch == '-');
    let placeholder = value.starts_with('$') || value.starts_with('<') || value.starts_with('{');
    let secretish = if password_class {
        !keyword && !placeholder
    } else {
        !keyword && !numeric && !placeholder && value.chars().count() >= 6
    };
    // Keys like `tokens`, `max_tokens` or `author` are counters and names.
    let counter_like = lower.trim_matches(['"', '\'']).ends_with("tokens")
        || lower.contains("_count")
        || lower.contains("author")
        || lower.contains("token_limit")
        || lower.contains("tokenizer");
    if secretish && !counter_like {
        format!("{key}{sep}{REDACTED}{end}")
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
        assert!(r.env_assign.is_some());
        assert!(r.quoted_field.is_some());
        assert!(r.password_assign.is_some());
        assert!(r.cli_flag.is_some());
        assert!(r.key_assign.is_some());
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
    fn code_and_counters_survive() {
        for t in [
            "let token = parse_token(input);",
            "MAX_TOKENS=4096",
            r#"{"max_tokens": 4096, "auth": "none"}"#,
            "tokenizer: cl100k_base",
            "the secret of good code is tests",
            "export API_KEY=$OPENAI_API_KEY",
        ] {
            assert_eq!(redact_secrets(t), t);
        }
    }

    #[test]
    fn env_quoted_and_cli_secrets() {
        assert_eq!(
            redact_secrets("GITHUB_TOKEN=abc123def456"),
            "GITHUB_TOKEN=[REDACTED]"
        );
        assert_eq!(
            redact_secrets(r#"config = {"apiKey": "live-abcdefgh"}"#),
            r#"config = {"apiKey": "[REDACTED]"}"#
        );
        assert_eq!(redact_secrets("token = 'abcdefgh'"), "token = '[REDACTED]'");
        assert_eq!(
            redact_secrets("tool --api-key xyz123456 --verbose"),
            "tool --api-key [REDACTED] --verbose"
        );
        assert_eq!(redact_secrets("--password=pw"), "--password=[REDACTED]");
        assert_eq!(
            redact_secrets("GET /v1?api_key=abcdef123456&x=1"),
            "GET /v1?api_key=[REDACTED]&x=1"
        );
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
