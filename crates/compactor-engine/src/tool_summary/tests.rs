//! One-line tool summaries: the ported web-extract cases and compactor's own.

use super::*;
use crate::tool_summary;
use serde_json::json;

#[test]
fn common_agent_tools() {
    let s = summarize_tool_result("Bash", r#"{"command":["git","status"]}"#, "a\nb");
    assert_eq!(s, "[Bash] ran `git status` -> exit ?, 2 lines output");
    let s = summarize_tool_result(
        "Read",
        r#"{"file_path":"/src/main.rs"}"#,
        &"x".repeat(2_048),
    );
    assert_eq!(s, "[Read] read /src/main.rs (2,048 chars)");
    let s = summarize_tool_result("Write", r#"{"file_path":"/a.txt","content":"1\n2"}"#, "ok");
    assert_eq!(s, "[Write] wrote to /a.txt (2 lines)");
    let s = summarize_tool_result(
        "Edit",
        r#"{"file_path":"/b.rs","old_string":"a","new_string":"b"}"#,
        "done",
    );
    assert_eq!(s, "[Edit] edited /b.rs (4 chars result)");
    let s = summarize_tool_result("Grep", r#"{"pattern":"TODO","path":"src"}"#, "x");
    assert_eq!(s, "[Grep] search for 'TODO' in src (1 chars result)");
    let s = summarize_tool_result("WebFetch", r#"{"url":"https://x.y/z"}"#, "abc");
    assert_eq!(s, "[WebFetch] https://x.y/z (3 chars)");
}

#[test]
fn clarify_keeps_answer_but_not_sentinels() {
    let s = summarize_tool_result("clarify", "{}", r#"{"answer": "use Postgres, not MySQL"}"#);
    assert_eq!(
        s,
        r#"[clarify] asked user a question; answer: "use Postgres, not MySQL""#
    );
    let s = summarize_tool_result(
        "clarify",
        "{}",
        r#"{"answer": "Clarify timed out waiting for user"}"#,
    );
    assert_eq!(s, "[clarify] asked user a question");
    let long = "y".repeat(1_000);
    let s = summarize_tool_result("clarify", "{}", &long);
    assert!(s.len() < 200, "{s}");
}

#[test]
fn skill_view_reload_hint_only_for_big_bodies() {
    let small = summarize_tool_result("skill_view", r#"{"name":"git"}"#, "short");
    assert_eq!(small, "[skill_view] name=git (5 chars)");
    let big = summarize_tool_result("skill_view", r#"{"name":"git"}"#, &"b".repeat(6_000));
    assert!(big.starts_with("[skill_view] name=git (6,000 chars;"));
    assert!(big.contains("reload"));
}

#[test]
fn thousands_separators() {
    assert_eq!(thousands(0), "0");
    assert_eq!(thousands(999), "999");
    assert_eq!(thousands(1_000), "1,000");
    assert_eq!(thousands(1_234_567), "1,234,567");
}

#[test]
fn terminal_line() {
    let s = summarize_tool_result(
        "terminal",
        r#"{"command":"cargo test"}"#,
        "{\"exit_code\": 0, \"output\": \"a\\nb\"}",
    );
    assert_eq!(s, "[terminal] ran `cargo test` -> exit 0, 1 lines output");
    let s = summarize_tool_result("terminal", "not json", "line1\nline2\nline3");
    assert_eq!(s, "[terminal] ran `` -> exit ?, 3 lines output");
}

#[test]
fn terminal_command_clipped_to_80() {
    let cmd = "x".repeat(200);
    let s = summarize_tool_result("terminal", &format!("{{\"command\":\"{cmd}\"}}"), "");
    assert!(s.contains(&format!("`{}...`", "x".repeat(77))), "{s}");
    assert!(s.ends_with("0 lines output"));
}

#[test]
fn read_and_write_file() {
    let s = summarize_tool_result(
        "read_file",
        r#"{"path":"/a/b.rs","offset":40}"#,
        &"z".repeat(1500),
    );
    assert_eq!(s, "[read_file] read /a/b.rs from line 40 (1,500 chars)");
    let s = summarize_tool_result(
        "write_file",
        r#"{"path":"/a/c.rs","content":"1\n2\n3"}"#,
        "ok",
    );
    assert_eq!(s, "[write_file] wrote to /a/c.rs (3 lines)");
}

#[test]
fn search_files_and_patch() {
    let s = summarize_tool_result(
        "search_files",
        r#"{"pattern":"fn main"}"#,
        r#"{"total_count": 7}"#,
    );
    assert_eq!(
        s,
        "[search_files] content search for 'fn main' in . -> 7 matches"
    );
    let s = summarize_tool_result("patch", r#"{"path":"/x"}"#, "done");
    assert_eq!(s, "[patch] replace in /x (4 chars result)");
}

#[test]
fn web_extract_multiple_urls() {
    let s = summarize_tool_result(
        "web_extract",
        r#"{"urls":["https://a", {"href":"https://b"}, "https://c"]}"#,
        "abc",
    );
    assert_eq!(s, "[web_extract] https://a (+2 more) (3 chars)");
}

#[test]
fn generic_fallback_uses_first_two_args() {
    let s = summarize_tool_result(
        "custom_tool",
        r#"{"zulu":"one","beta":2,"alpha":"three"}"#,
        "xyz",
    );
    assert_eq!(s, "[custom_tool] zulu=one beta=2 (3 chars result)");
    let s = summarize_tool_result("custom_tool", "[1,2]", "");
    assert_eq!(s, "[custom_tool] (0 chars result)");
}

/// `TestSummarizeToolResultWebExtract`
mod summarize_tool_result_web_extract {
    use super::*;

    // >200 chars so the pruning pass actually summarizes.
    fn content() -> String {
        "x".repeat(500)
    }

    #[test]
    fn single_dict_url_is_unwrapped_not_stringified() {
        let a = json!({"urls": [{"url": "https://example.com/a", "title": "A"}]}).to_string();
        let summary = tool_summary::summarize_tool_result("web_extract", &a, &content());
        assert_eq!(summary, "[web_extract] https://example.com/a (500 chars)");
        assert!(!summary.contains('{'));
    }

    #[test]
    fn href_key_is_unwrapped() {
        let a = json!({"urls": [{"href": "https://example.com/h"}]}).to_string();
        let summary = tool_summary::summarize_tool_result("web_extract", &a, &content());
        assert_eq!(summary, "[web_extract] https://example.com/h (500 chars)");
    }
}
