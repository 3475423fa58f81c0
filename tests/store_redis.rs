//! The Redis/Valkey store, against a real `redis-server` started by the
//! test (installed by `scripts/install_prereqs.sh`): the backend itself,
//! two proxies sharing one Redis (turns alternating between them, one
//! summary per compaction, no cross-credential sharing), a Redis killed
//! mid-run, and the compaction lock.

// Test code: a failed unwrap is a failed test. clippy.toml allows that in
// #[test] functions only, not in the helpers they share.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use compactor::store::redis::RedisStore;
use compactor::store::{Store, StoredRecord};
use serde_json::Value;
use support::chat::*;
use support::redis::RedisServer;

const ALICE: (&str, &str) = ("authorization", "Bearer alice");
const BOB: (&str, &str) = ("authorization", "Bearer bob");
const TOKEN: &str = "admin-secret";

fn config(redis: &RedisServer) -> String {
    format!(
        "[admin]\ntoken = \"{TOKEN}\"\n[models.\"m\"]\ncontext_length = 2048\n\
         [store]\nurl = \"{}\"\ntimeout_ms = 500\n",
        redis.url()
    )
}

fn rec(k: usize, h: u128, text: &str) -> StoredRecord {
    StoredRecord {
        k,
        prefix_hash: h,
        replacement: vec![text.to_owned()],
        original_tokens: 100,
        replacement_tokens: 10,
        summary_rows: None,
    }
}

fn open(redis: &RedisServer, ttl: Duration, max_bytes: usize) -> RedisStore {
    RedisStore::open(&redis.url(), ttl, max_bytes).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backend_shares_records_secret_windows_state_and_locks() {
    let redis = RedisServer::start();
    let a = open(&redis, Duration::from_secs(60), 1 << 20);
    let b = open(&redis, Duration::from_secs(60), 1 << 20);
    assert!(a.keyer_secret().is_some());
    assert_eq!(a.keyer_secret(), b.keyer_secret(), "one secret for all");
    assert!(!b.may_have(100), "no record anywhere: no round trip");

    a.put(1, rec(2, 22, "{\"a\":\"é\"}")).await.unwrap();
    a.put(1, rec(4, 44, "{\"b\":2}")).await.unwrap();
    // B finds A's records at once (the script walks the server's lengths).
    let hit = b.find(1, &[11, 22, 33, 44, 55]).await.unwrap().unwrap();
    assert_eq!(hit, rec(4, 44, "{\"b\":2}"));
    assert_eq!(b.find(1, &[11, 22, 99]).await.unwrap().unwrap().k, 2);
    assert!(
        b.find(2, &[11, 22, 33, 44]).await.unwrap().is_none(),
        "other credential"
    );
    b.sweep().await.unwrap();
    assert!(
        b.may_have(2) && !b.may_have(1),
        "lengths learned by the sweep"
    );

    a.put_window("http://u:1", "m", 8192).await.unwrap();
    let c = open(&redis, Duration::from_secs(60), 1 << 20);
    assert_eq!(c.windows(), vec![("http://u:1".into(), "m".into(), 8192)]);
    assert!(c.may_have(2), "lengths read at open");

    a.put_state(9, b"state".to_vec()).await.unwrap();
    assert_eq!(
        b.get_state(9).await.unwrap().as_deref(),
        Some(&b"state"[..])
    );
    assert_eq!(b.get_state(10).await.unwrap(), None);

    let ttl = Duration::from_secs(30);
    assert!(a.try_lock(1, 77, 111, ttl).await.unwrap());
    assert!(!b.try_lock(1, 77, 222, ttl).await.unwrap(), "held");
    b.unlock(1, 77, 222).await.unwrap(); // not the owner: no effect
    assert!(!b.try_lock(1, 77, 222, ttl).await.unwrap(), "still held");
    a.unlock(1, 77, 111).await.unwrap();
    assert!(
        b.try_lock(1, 77, 222, ttl).await.unwrap(),
        "released by its owner"
    );
    assert!(a
        .try_lock(1, 78, 1, Duration::from_millis(50))
        .await
        .unwrap());
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert!(b.try_lock(1, 78, 2, ttl).await.unwrap(), "a lock expires");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_pre_compaction_replicas_alternating_still_send_one_prefix() {
    let redis = RedisServer::start();
    let mock = ChatMock::start(Settings::default()).await;
    let cfg = format!("{}[compaction]\nbackground = true\n", config(&redis));
    let a = support::start_proxy(&mock.url(), &cfg).await;
    let b = support::start_proxy(&mock.url(), &cfg).await;
    let replicas = [a.url(), b.url()];
    let mut conv = Conversation::new(600);
    let mut compacted_sent: Option<Vec<Value>> = None;
    let mut checked = 0;
    for i in 0..30 {
        let (h, _) = turn(&replicas[i % 2], &mock, &mut conv, ALICE).await;
        let sent = mock.last_chat().messages();
        if action(&h) == "compacted" {
            compacted_sent = Some(sent);
        } else if let Some(first) = compacted_sent.take() {
            assert!(substituted(&h), "turn {i}: {}", action(&h));
            let n = replacement_len(&sent, &conv, &h);
            assert_eq!(sent[..n], first[..n], "turn {i}: identical prefix");
            checked += 1;
        }
    }
    assert!(checked >= 2, "{checked}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_and_the_database_come_from_the_url() {
    let redis = RedisServer::start_with(&["--requirepass", "s3cr:t"]);
    let url = |auth: &str, db: u32| format!("redis://{auth}@127.0.0.1:{}/{db}", redis.port);
    let ttl = Duration::from_secs(60);
    // Wrong password: the store opens (and will retry) but every call fails.
    let wrong = RedisStore::open(&url(":nope", 0), ttl, 1 << 20).unwrap();
    assert_eq!(wrong.keyer_secret(), None);
    assert!(wrong.put(1, rec(1, 1, "{}")).await.is_err());
    // The password (percent-encoded), bare and as the ACL default user.
    let db0 = RedisStore::open(&url(":s3cr%3At", 0), ttl, 1 << 20).unwrap();
    let acl = RedisStore::open(&url("default:s3cr%3At", 0), ttl, 1 << 20).unwrap();
    assert!(db0.keyer_secret().is_some());
    assert_eq!(db0.keyer_secret(), acl.keyer_secret());
    db0.put(1, rec(1, 1, "{}")).await.unwrap();
    assert!(acl.find(1, &[1]).await.unwrap().is_some());
    // Another database is another store.
    let db3 = RedisStore::open(&url(":s3cr%3At", 3), ttl, 1 << 20).unwrap();
    assert!(db3.find(1, &[1]).await.unwrap().is_none());
    assert_ne!(db3.keyer_secret(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_bounds_bytes_oldest_first_and_records_expire() {
    let redis = RedisServer::start();
    let s = open(&redis, Duration::from_secs(60), 3000);
    for h in 1..=3u128 {
        s.put(1, rec(1, h, &"x".repeat(900))).await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Used from memory: the sweep renews it before it bounds the bytes.
    s.touch(1, 1);
    s.put(1, rec(1, 4, &"x".repeat(900))).await.unwrap();
    s.sweep().await.unwrap();
    assert!(s.find(1, &[2]).await.unwrap().is_none(), "oldest dropped");
    assert!(s.find(1, &[1]).await.unwrap().is_some(), "touched kept");
    assert!(s.find(1, &[4]).await.unwrap().is_some());

    let short = open(&redis, Duration::from_millis(100), 1 << 20);
    short.put(2, rec(1, 5, "{}")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert!(short.find(2, &[5]).await.unwrap().is_none(), "expired (PX)");
    short.sweep().await.unwrap();
}

/// Drives `conv` one turn through `proxy`; returns the response headers and
/// the summary calls the turn made.
async fn turn(
    proxy: &str,
    mock: &ChatMock,
    conv: &mut Conversation,
    who: (&str, &str),
) -> (http::HeaderMap, usize) {
    let before = mock.summaries().len();
    let sent = conv.ask();
    let (st, h, body) = post_chat(proxy, chat_body("m", &sent, false), &[who]).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    conv.answer();
    (h, mock.summaries().len() - before)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_alternating_share_records_and_summarise_once_per_compaction() {
    let redis = RedisServer::start();
    let mock = ChatMock::start(Settings::default()).await;
    let a = support::start_proxy(&mock.url(), &config(&redis)).await;
    let b = support::start_proxy(&mock.url(), &config(&redis)).await;
    let replicas = [a.url(), b.url()];
    let mut conv = Conversation::new(600);
    let mut compactions = 0;
    let mut after_compaction = 0;
    let mut compacted_sent: Option<Vec<Value>> = None;
    for i in 0..30 {
        let proxy = &replicas[i % 2];
        let (h, calls) = turn(proxy, &mock, &mut conv, ALICE).await;
        let sent = mock.last_chat().messages();
        if action(&h) == "compacted" {
            compactions += 1;
            assert!(calls > 0);
            compacted_sent = Some(sent);
            continue;
        }
        assert_eq!(calls, 0, "turn {i} ({}) made a summary call", action(&h));
        if compactions == 0 {
            // No record anywhere yet: a passthrough turn asks Redis nothing.
            let misses = "compactor_store_read_misses_total{backend=\"redis\"}";
            assert_eq!(metric(proxy, misses).await, 0.0, "turn {i}");
        }
        if let Some(first) = compacted_sent.take() {
            // The other replica, right after the compaction: the record is
            // found through Redis and the same replacement bytes go first.
            assert!(substituted(&h), "turn {i}: {}", action(&h));
            let n = replacement_len(&sent, &conv, &h);
            assert_eq!(sent[..n], first[..n], "turn {i}: identical prefix");
            after_compaction += 1;
        }
    }
    assert!(compactions >= 2, "{compactions}");
    assert!(after_compaction >= 2, "{after_compaction}");

    // Bob sends Alice's whole history: he never finds her records (his
    // compaction is his own, with its own summary call).
    let mut stolen = Conversation::new(600);
    stolen.messages = conv.messages.clone();
    stolen.turns = conv.turns;
    let (h, calls) = turn(&replicas[1], &mock, &mut stolen, BOB).await;
    assert_eq!(action(&h), "compacted");
    assert!(calls > 0, "Bob summarised himself");
}

/// Messages of the replacement at the front of `sent`: a substituted
/// request is the replacement followed by the client's messages after the
/// `x-compactor-replaced` ones (`conv` has had its answer appended).
fn replacement_len(sent: &[Value], conv: &Conversation, h: &http::HeaderMap) -> usize {
    let client = conv.messages.len() - 3;
    sent.len() - (client - replaced(h))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_compacting_the_same_history_at_once_make_one_summary_call() {
    let redis = RedisServer::start();
    let mock = ChatMock::start(Settings {
        summary_delay: Duration::from_millis(600),
        ..Settings::default()
    })
    .await;
    let a = support::start_proxy(&mock.url(), &config(&redis)).await;
    let b = support::start_proxy(&mock.url(), &config(&redis)).await;
    // A history well over the trigger, new to both replicas.
    let mut conv = Conversation::new(600);
    for _ in 0..14 {
        conv.ask();
        conv.answer();
    }
    let body = chat_body("m", &conv.ask(), false);
    let (ua, ub) = (a.url(), b.url());
    let (ra, rb) = tokio::join!(
        post_chat(&ua, body.clone(), &[ALICE]),
        post_chat(&ub, body.clone(), &[ALICE]),
    );
    assert_eq!((ra.0.as_u16(), rb.0.as_u16()), (200, 200));
    let actions = [action(&ra.1).to_owned(), action(&rb.1).to_owned()];
    assert!(
        actions.contains(&"compacted".to_owned()) && (substituted(&ra.1) || substituted(&rb.1)),
        "one compacts, the other uses its record: {actions:?}"
    );
    let compacting = if actions[0] == "compacted" { &a } else { &b };
    let waiting = if actions[0] == "compacted" { &b } else { &a };
    let calls = metric(&compacting.url(), "compactor_summariser_seconds_count").await;
    assert!(calls >= 1.0);
    assert_eq!(
        metric(&waiting.url(), "compactor_summariser_seconds_count").await,
        0.0,
        "the waiting replica made no summary call"
    );
    assert_eq!(
        metric(
            &waiting.url(),
            "compactor_store_peer_records_total{backend=\"redis\"}"
        )
        .await,
        1.0
    );
    let chats = mock.chats();
    let (x, y) = (&chats[chats.len() - 2], &chats[chats.len() - 1]);
    assert_eq!(x.messages(), y.messages(), "both sent the same replacement");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_whose_compaction_failed_hands_the_lock_over() {
    let redis = RedisServer::start();
    // 401: the summary fails for good and the owner's compaction is aborted
    // (no record), after a delay that lets the other replica find the lock held.
    let mock = ChatMock::start(Settings {
        summary: SummaryMode::Status(401),
        summary_delay: Duration::from_millis(600),
        ..Settings::default()
    })
    .await;
    let a = support::start_proxy(&mock.url(), &config(&redis)).await;
    let b = support::start_proxy(&mock.url(), &config(&redis)).await;
    let mut conv = Conversation::new(600);
    for _ in 0..14 {
        conv.ask();
        conv.answer();
    }
    let body = chat_body("m", &conv.ask(), false);
    let (ua, ub) = (a.url(), b.url());
    let both = async {
        tokio::join!(
            post_chat(&ua, body.clone(), &[ALICE]),
            post_chat(&ub, body.clone(), &[ALICE]),
        )
    };
    // The summary timeout is 600 s: a waiter that did not see the lock
    // released would hang far past this guard.
    let (ra, rb) = tokio::time::timeout(Duration::from_secs(60), both)
        .await
        .expect("the waiting replica took over when the lock was released");
    assert_eq!((ra.0.as_u16(), rb.0.as_u16()), (200, 200));
    assert_eq!((action(&ra.1), action(&rb.1)), ("aborted", "aborted"));
    assert_eq!(mock.summaries().len(), 2, "each replica tried once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_hangs_degrades_within_its_timeout_and_recovers() {
    let redis = RedisServer::start();
    let mock = ChatMock::start(Settings::default()).await;
    let a = support::start_proxy(&mock.url(), &config(&redis)).await;
    let b = support::start_proxy(&mock.url(), &config(&redis)).await;
    let degraded = "compactor_store_degraded_total{backend=\"redis\"}";
    let mut alice = Conversation::new(600);
    let mut compacted = false;
    for _ in 0..20 {
        let (h, _) = turn(&a.url(), &mock, &mut alice, ALICE).await;
        if action(&h) == "compacted" {
            compacted = true;
            break;
        }
    }
    assert!(compacted);
    tokio::time::sleep(Duration::from_millis(300)).await;

    redis.pause();
    // A new conversation's first turn asks the store for its state: the
    // call times out (500 ms here), the turn goes on from memory.
    let mut bob = Conversation::new(600);
    let (h, _) = turn(&b.url(), &mock, &mut bob, BOB).await;
    assert_eq!(action(&h), "passthrough");
    // Alice's record still serves from A's memory.
    let (h, _) = turn(&a.url(), &mock, &mut alice, ALICE).await;
    assert!(compacted_or_substituted(&h), "{}", action(&h));
    assert!(
        metric(&b.url(), degraded).await >= 1.0,
        "the hung call is counted"
    );

    redis.resume();
    // Thawed: Alice's record is found by B through the store.
    let (h, calls) = turn(&b.url(), &mock, &mut alice, ALICE).await;
    assert!(substituted(&h), "{}", action(&h));
    assert_eq!(calls, 0);
    let hits = "compactor_store_read_hits_total{backend=\"redis\"}";
    assert!(
        metric(&b.url(), hits).await >= 1.0,
        "the store answers again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_killed_mid_run_degrades_to_memory_and_is_used_again_when_back() {
    let mut redis = RedisServer::start();
    let mock = ChatMock::start(Settings::default()).await;
    let a = support::start_proxy(&mock.url(), &config(&redis)).await;
    let b = support::start_proxy(&mock.url(), &config(&redis)).await;
    let degraded = "compactor_store_degraded_total{backend=\"redis\"}";

    // Alice's conversation on A until it compacts.
    let mut alice = Conversation::new(600);
    let mut compacted = false;
    for _ in 0..20 {
        let (h, _) = turn(&a.url(), &mock, &mut alice, ALICE).await;
        if action(&h) == "compacted" {
            compacted = true;
            break;
        }
    }
    assert!(compacted);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(metric(&a.url(), degraded).await, 0.0);

    redis.kill();
    // Requests still pass; A's record still serves from memory (nothing lost).
    for _ in 0..3 {
        let (h, _) = turn(&a.url(), &mock, &mut alice, ALICE).await;
        assert!(compacted_or_substituted(&h), "{}", action(&h));
    }
    // A new conversation on B compacts with the store down.
    let mut bob = Conversation::new(600);
    let mut bob_compacted = false;
    for _ in 0..20 {
        let (h, _) = turn(&b.url(), &mock, &mut bob, BOB).await;
        if action(&h) == "compacted" {
            bob_compacted = true;
            break;
        }
    }
    assert!(bob_compacted);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let down = metric(&a.url(), degraded).await + metric(&b.url(), degraded).await;
    assert!(down >= 1.0, "failures counted: {down}");

    redis.up();
    // Back: a compaction on A is found by B through the store again.
    let mut carol = Conversation::new(600);
    let carol_key = ("authorization", "Bearer carol");
    let mut at = None;
    for i in 0..20 {
        let (h, _) = turn(&a.url(), &mock, &mut carol, carol_key).await;
        if action(&h) == "compacted" {
            at = Some(i);
            break;
        }
    }
    assert!(at.is_some());
    let first = mock.last_chat().messages();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (h, calls) = turn(&b.url(), &mock, &mut carol, carol_key).await;
    assert!(substituted(&h), "found through the store: {}", action(&h));
    assert_eq!(calls, 0);
    let sent = mock.last_chat().messages();
    let n = replacement_len(&sent, &carol, &h);
    assert_eq!(sent[..n], first[..n]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_on_the_same_store_keeps_cooldown_and_calibration() {
    let redis = RedisServer::start();
    let mock = ChatMock::start(Settings {
        summary: SummaryMode::Status(500),
        bytes_per_token: 2.0,
        ..Settings::default()
    })
    .await;
    let a = support::start_proxy(&mock.url(), &config(&redis)).await;
    let mut conv = Conversation::new(600);
    let mut key = String::new();
    let mut failed = false;
    for _ in 0..25 {
        let (h, calls) = turn(&a.url(), &mock, &mut conv, ALICE).await;
        key = session_of(&h);
        if calls > 0 {
            failed = true;
            break;
        }
    }
    assert!(failed, "a summary call was made (and failed)");
    let (_, before) = admin_view(&a.url(), TOKEN, &key).await;
    let cooldown = &before["trigger"]["cooldown_remaining_secs"];
    assert!(cooldown.as_u64().is_some_and(|s| s > 0), "{before}");
    let reports = before["usage_reports"].as_u64().unwrap();
    assert!(reports >= 2, "{before}");
    // One more turn on A writes the state that turn learned (in the background).
    let (_, calls) = turn(&a.url(), &mock, &mut conv, ALICE).await;
    assert_eq!(calls, 0, "in cooldown: the summariser is not asked");
    let (_, last) = admin_view(&a.url(), TOKEN, &key).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(a);

    let c = support::start_proxy(&mock.url(), &config(&redis)).await;
    let (h, calls) = turn(&c.url(), &mock, &mut conv, ALICE).await;
    assert_eq!(
        session_of(&h),
        key,
        "the same session key after the restart"
    );
    assert_eq!(calls, 0, "still in cooldown after the restart");
    let (_, after) = admin_view(&c.url(), TOKEN, &key).await;
    let cooldown = &after["trigger"]["cooldown_remaining_secs"];
    assert!(cooldown.as_u64().is_some_and(|s| s > 0), "{after}");
    // C saw one usage report itself; the rest came with the stored calibration.
    assert!(
        after["usage_reports"].as_u64().unwrap() >= 2,
        "calibration carried over: {after}"
    );
    let ratio = after["calibration_ratio"].as_f64().unwrap();
    assert!((1.8..2.2).contains(&ratio), "{after}");
    // The count goes on from A's (C may compact once more, from the
    // deterministic fallback: the cooldown keeps the summariser out).
    let count = |v: &Value| v["trigger"]["compression_count"].as_u64().unwrap();
    let here = u64::from(action(&h) == "compacted");
    assert_eq!(count(&after), count(&last) + here, "{after}");
}
