//! Splicing the summary in, and the user-turn guarantee.

use super::*;
use crate::test_support::{content_str, msg};

fn m(role: &str, c: &str) -> Value {
    json!({"role": role, "content": c})
}

fn tc() -> Value {
    json!({"role": "assistant", "content": null, "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{}"}}]})
}

#[test]
fn forced_user_never_puts_an_assistant_first() {
    let head = vec![m("system", "s")];
    let tail = vec![
        tc(),
        json!({"role": "tool", "tool_call_id": "a", "content": "r"}),
        m("user", "u"),
    ];
    assert_eq!(
        choose_placement(&head, &tail),
        Placement::Standalone("user")
    );
}

#[test]
fn forced_user_merges_into_a_leading_user_row() {
    let head = vec![m("system", "s")];
    let tail = vec![m("user", "u"), m("assistant", "a")];
    assert_eq!(choose_placement(&head, &tail), Placement::MergeUserLeading);
    let out = assemble(head, "SUM", tail);
    assert_eq!(out.summary_index, 1);
    let t = view::text(&out.messages[1]);
    assert!(t.starts_with("SUM") && t.ends_with("u"));
}

#[test]
fn double_collision_merges_into_tail_and_flip_is_used_when_free() {
    let head = vec![m("system", "s"), m("user", "u"), m("assistant", "a")];
    assert_eq!(
        choose_placement(&head, &[m("user", "u2")]),
        Placement::MergeIntoTail
    );
    assert_eq!(
        choose_placement(&head, &[m("assistant", "a2")]),
        Placement::Standalone("user")
    );
    let head = vec![m("system", "s"), m("user", "u")];
    assert_eq!(
        choose_placement(&head, &[m("user", "u2")]),
        Placement::Standalone("assistant")
    );
}

#[test]
fn tool_rows_are_invisible_but_raw_neighbours_still_count() {
    // head ends user → assistant(tc) → tool: the visible last head role is
    // user, the raw one is tool; a following user row forbids a user summary.
    let head = vec![
        m("system", "s"),
        m("user", "u"),
        tc(),
        json!({"role": "tool", "tool_call_id": "a", "content": "r"}),
    ];
    assert_eq!(
        choose_placement(&head, &[m("user", "next")]),
        Placement::Standalone("assistant")
    );
}

#[test]
fn user_turn_guarantee_reinserts_or_marks() {
    let original = vec![
        msg("system", "s"),
        msg("user", "the ask"),
        msg("assistant", "a"),
    ];
    let mut out = vec![msg("system", "s"), msg("assistant", "summary-ish")];
    assert!(ensure_user_turn(&mut out, &original));
    assert_eq!(content_str(out.last().unwrap()), "the ask");

    let no_user = vec![msg("system", "s"), msg("assistant", "a")];
    let mut out = vec![msg("system", "s"), msg("assistant", "x")];
    ensure_user_turn(&mut out, &no_user);
    assert_eq!(content_str(out.last().unwrap()), NO_USER_TURN_MARKER);
}
