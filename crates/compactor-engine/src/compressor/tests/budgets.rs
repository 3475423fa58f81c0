//! What a compaction may spend: chunked summaries within the summariser's
//! prompt budget (a bounded running summary among them), one configuration
//! for the compressor and its trigger, the reply cap by the room above the
//! fixed part, and the user's own words kept in the summary's section
//! (moved from tests/engine_small_windows.rs and tests/engine_economy.rs:
//! they read the compressor's insides).

use std::sync::Arc;

use crate::compressor::{CompressOptions, Outcome};
use crate::serialize::prompt_overhead_chars;
use crate::summariser::SummaryReply;
use crate::test_support::*;
use crate::user_messages;

// ---------------------------------------------------------------- small windows, chunked summaries

#[test]
fn long_middle_is_summarised_in_rolling_chunks_within_budget() {
    let mut c = compressor(1, 2);
    let mut msgs = vec![msg("system", "sys")];
    for i in 0..60 {
        msgs.push(msg("user", &format!("question {i} {}", "q".repeat(900))));
        msgs.push(msg("assistant", &format!("answer {i} {}", "a".repeat(900))));
    }
    let budget = prompt_overhead_chars(None, false) + 12_000;
    let s = Stub::seq(
        (0..40)
            .map(|k| Ok(SummaryReply::text(format!("RUNNING-{k}"))))
            .collect(),
    )
    .with_budget(budget);
    let res = block_on(c.compress(
        &msgs,
        &s,
        CompressOptions {
            force: true,
            ..Default::default()
        },
    ));
    assert_eq!(res.outcome, Outcome::Compacted);
    let reqs = s.requests.lock().unwrap().clone();
    assert!(reqs.len() > 1, "the middle must be chunked");
    assert!(reqs.len() <= 8, "chunking is bounded");
    for r in &reqs {
        assert!(
            r.prompt.chars().count() <= budget,
            "{} > {budget}",
            r.prompt.chars().count()
        );
        assert_eq!(r.max_tokens, None);
    }
    // Rolling: every later chunk updates the running summary of the previous one.
    for (k, r) in reqs.iter().enumerate().skip(1) {
        assert!(
            r.prompt.contains(&format!("RUNNING-{}", k - 1)),
            "chunk {k} lacks the running summary"
        );
    }
    let last = format!("RUNNING-{}", reqs.len() - 1);
    assert!(content_str(&res.messages[res.summary_index.unwrap()]).contains(&last));
}

#[test]
fn arc_config_is_shared() {
    // The trigger and the compressor read the same config.
    let c = compressor(1, 2);
    assert!(Arc::ptr_eq(&c.cfg, c.trigger.config()));
}

#[test]
fn large_previous_summary_is_bounded_to_the_summariser_budget() {
    let mut c = compressor(1, 2);
    c.previous_summary = Some(format!("PREV {}", "p".repeat(50_000)));
    let mut msgs = vec![
        msg("system", "sys"),
        summary_msg("user", &format!("{}\nold", crate::markers::SUMMARY_PREFIX)),
    ];
    msgs.extend(alternating(12, "turn "));
    let budget = prompt_overhead_chars(None, false) + 6_000;
    let s = Stub::ok("sum").with_budget(budget);
    let res = block_on(c.compress(
        &msgs,
        &s,
        CompressOptions {
            force: true,
            ..Default::default()
        },
    ));
    assert_eq!(res.outcome, Outcome::Compacted);
    for r in s.requests.lock().unwrap().iter() {
        assert!(
            r.prompt.chars().count() <= budget,
            "{} > {budget}",
            r.prompt.chars().count()
        );
        assert!(r.prompt.contains("PREV"));
    }
}

// ---------------------------------------------------------------- economy

/// With a fixed part the summary call's reply cap follows the room above
/// it: a cap from the window alone let a small model write 1,600 tokens of
/// a summary that could keep ~150.
#[test]
fn a_large_fixed_part_caps_the_summary_reply_by_its_room() {
    let mut c = compressor_with("m", 8_192, |_| {});
    let by_window = c.trigger.summariser_budgets().reply_tokens.expect("a cap");
    c.trigger.set_fixed_tokens(6_300);
    let room = c.trigger.history_target();
    let reply = c.trigger.summariser_budgets().reply_tokens.expect("a cap");
    let most = c.trigger.max_summary_tokens();
    assert!(
        u64::from(reply) < room,
        "reply cap {reply} over the history target {room}"
    );
    assert!(
        u64::from(reply) >= most,
        "{reply} under the summary's own budget {most}"
    );
    assert!(
        reply < by_window / 4,
        "{reply} vs {by_window} by the window"
    );
}

/// Facts the user stated in the first turns are in every later request:
/// verbatim in the summary's section, across two compactions.
#[test]
fn the_user_s_own_words_survive_two_compactions() {
    let mut c = compressor_with("m", 4_096, |c| c.protect_first_n = 0);
    let mut msgs = vec![
        msg("system", "You are an agent."),
        msg("user", "My vault is at /srv/vault-7."),
        msg("assistant", "Noted."),
        msg("user", "Use port 8443 for the service."),
        msg("assistant", "Noted."),
        msg("user", "The access code is K-19-ALPHA."),
        msg("assistant", "Noted."),
    ];
    let s = Stub::ok("## Historical Task Snapshot\nthe task\n## Completed Actions\n1. read files");
    for round in 0..2 {
        for i in 0..8 {
            msgs.extend(read_round(round * 10 + i, 800));
        }
        msgs.push(msg("user", "continue"));
        let r = block_on(c.compress(
            &msgs,
            &s,
            CompressOptions {
                force: true,
                ..Default::default()
            },
        ));
        assert_eq!(r.outcome, Outcome::Compacted, "round {round}");
        let si = r.summary_index.unwrap();
        let (_, said) =
            user_messages::split(&crate::markers::summary_body(&content_str(&r.messages[si])));
        for fact in ["/srv/vault-7", "port 8443", "K-19-ALPHA"] {
            assert!(
                said.iter().any(|m| m.contains(fact)),
                "round {round}: {fact} lost: {said:?}"
            );
        }
        // The summariser never saw the section.
        assert!(!s.last_request().prompt.contains(user_messages::HEADING));
        msgs = r.messages;
    }
}
