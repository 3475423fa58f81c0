//! The chat path's one surface onto the [`crate::store`]: find a record
//! (memory first, the store on a miss) and commit one (memory now, the
//! store in the background); and learned windows (kept in the store too).

use std::sync::Arc;

use serde_json::value::RawValue;

use crate::store::StoredRecord;

use super::record::Record;
use super::ChatState;

impl ChatState {
    /// The longest record of this credential matching `hashes`. Memory
    /// first; the store only on a miss and only when it may hold a record
    /// that short (so a passthrough turn of a never-compacted
    /// conversation costs no store call). A store record is kept in memory
    /// from then on.
    pub(super) async fn find_record(
        &self,
        cred: u128,
        hashes: &[u128],
        hint: Option<&Arc<Record>>,
    ) -> Option<Arc<Record>> {
        if let Some(rec) = self.records.lookup(cred, hashes, hint) {
            self.store.touch(cred, rec.prefix_hash);
            return Some(rec);
        }
        if !self.store.may_have(hashes.len()) {
            return None;
        }
        let stored = self.store.find(cred, hashes).await?;
        self.adopt_record(cred, hashes, stored)
    }

    /// Keeps a record read from the store in memory, if it matches
    /// `hashes` and its messages are still valid JSON.
    pub(super) fn adopt_record(
        &self,
        cred: u128,
        hashes: &[u128],
        stored: StoredRecord,
    ) -> Option<Arc<Record>> {
        let matches =
            stored.k >= 1 && stored.k <= hashes.len() && hashes[stored.k - 1] == stored.prefix_hash;
        let record = from_stored(stored).filter(|_| matches)?;
        Some(self.records.insert(cred, record))
    }

    /// Commits a record: into memory now, written through to the store in
    /// the background (a failed write is logged and counted; the record
    /// still serves from memory).
    pub(super) fn commit_record(&self, cred: u128, record: Record) -> Arc<Record> {
        let stored = to_stored(&record);
        let rec = self.records.insert(cred, record);
        if self.store.name() != "memory" {
            self.store.put_in_background(cred, stored);
        }
        rec
    }
}

impl ChatState {
    /// Learns the window from an overflow error; a window learned is kept
    /// in the store (in the background), so a restart does not overflow
    /// again to learn it.
    pub(super) fn learn_window(&self, model: &str, overflow: &crate::window::overflow::Overflow) {
        if let Some(tokens) = self.windows.learn(&self.upstream_label, model, overflow) {
            if self.store.name() != "memory" {
                self.store
                    .put_window_in_background(&self.upstream_label, model, tokens);
            }
        }
    }
}

pub(super) fn to_stored(r: &Record) -> StoredRecord {
    StoredRecord {
        k: r.k,
        prefix_hash: r.prefix_hash,
        replacement: r.replacement.iter().map(|m| m.get().to_owned()).collect(),
        original_tokens: r.original_tokens,
        replacement_tokens: r.replacement_tokens,
        summary_rows: r.stored_summary_rows().map(<[usize]>::to_vec),
    }
}

/// `None` when a stored message is no longer valid JSON (then the record is
/// not used).
fn from_stored(s: StoredRecord) -> Option<Record> {
    let replacement = s
        .replacement
        .into_iter()
        .map(RawValue::from_string)
        .collect::<Result<Vec<_>, _>>()
        .ok()?;
    let record = Record::new(
        s.k,
        s.prefix_hash,
        replacement,
        s.original_tokens,
        s.replacement_tokens,
    );
    Some(match s.summary_rows {
        Some(rows) => record.with_summary_rows(rows),
        None => record,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_records_round_trip_byte_for_byte() {
        let text = "{\"role\":\"user\", \"content\":\"h\\u00e9 \\\"x\\\"\"}";
        let r = Record::new(
            3,
            7,
            vec![RawValue::from_string(text.into()).unwrap()],
            40,
            4,
        );
        let back = from_stored(to_stored(&r)).unwrap();
        assert_eq!(back.stored_summary_rows(), None);
        let rows = Record::new(3, 7, back.replacement.clone(), 40, 4).with_summary_rows(vec![0]);
        let declared = from_stored(to_stored(&rows)).unwrap();
        assert_eq!(declared.stored_summary_rows(), Some(&[0][..]));
        assert_eq!(back.replacement[0].get(), text);
        assert_eq!((back.k, back.prefix_hash), (3, 7));
        assert_eq!((back.original_tokens, back.replacement_tokens), (40, 4));
        let json = serde_json::to_string(&to_stored(&r)).unwrap();
        let s: StoredRecord = serde_json::from_str(&json).unwrap();
        assert_eq!(s, to_stored(&r));
    }

    #[test]
    fn undecodable_replacements_are_not_used() {
        let s = StoredRecord {
            k: 1,
            prefix_hash: 1,
            replacement: vec!["{oops".into()],
            original_tokens: 0,
            replacement_tokens: 0,
            summary_rows: None,
        };
        assert!(from_stored(s).is_none());
    }

    /// A store that is down (every call fails) or slow (every call hangs).
    struct Broken {
        slow: bool,
    }

    #[async_trait::async_trait]
    impl crate::store::Store for Broken {
        fn name(&self) -> &'static str {
            "broken"
        }
        fn may_have(&self, _len: usize) -> bool {
            true
        }
        async fn find(
            &self,
            _: u128,
            _: &[u128],
        ) -> Result<Option<StoredRecord>, crate::store::StoreError> {
            self.fail().await
        }
        async fn put(&self, _: u128, _: StoredRecord) -> Result<(), crate::store::StoreError> {
            self.fail().await
        }
        async fn sweep(&self) -> Result<(), crate::store::StoreError> {
            self.fail().await
        }
    }

    impl Broken {
        async fn fail<T>(&self) -> Result<T, crate::store::StoreError> {
            if self.slow {
                tokio::time::sleep(std::time::Duration::from_secs(30)).await;
            }
            Err(crate::store::StoreError::Backend(
                "connection refused".into(),
            ))
        }
    }

    fn chat_on(slow: bool) -> ChatState {
        let metrics = Arc::new(crate::metrics::Metrics::default());
        let mut chat = ChatState::from_config(&crate::config::Config::default(), metrics).unwrap();
        chat.store = crate::store::StoreHandle::new(
            Arc::new(Broken { slow }),
            std::time::Duration::from_millis(50),
        );
        chat
    }

    fn degraded(chat: &ChatState) -> u64 {
        chat.store
            .health
            .degraded
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    #[tokio::test]
    async fn a_store_that_is_down_or_slow_degrades_to_memory() {
        for slow in [false, true] {
            let chat = chat_on(slow);
            let started = std::time::Instant::now();
            // A miss asks the store, which fails: nothing found, counted.
            assert!(chat.find_record(1, &[11, 22, 33], None).await.is_none());
            assert_eq!(degraded(&chat), 1, "slow={slow}");
            // A commit keeps the record in memory whatever the store does.
            let raw = RawValue::from_string("{\"a\":1}".into()).unwrap();
            chat.commit_record(1, Record::new(2, 22, vec![raw], 10, 1));
            let hit = chat.find_record(1, &[11, 22, 33], None).await.unwrap();
            assert_eq!(hit.replacement[0].get(), "{\"a\":1}");
            // The background write fails (or times out) and is counted.
            tokio::time::sleep(std::time::Duration::from_millis(150)).await;
            assert_eq!(degraded(&chat), 2, "slow={slow}");
            assert!(started.elapsed() < std::time::Duration::from_secs(5));
            let text = chat.store.health.render(chat.store.name());
            assert!(text.contains("compactor_store_degraded_total{backend=\"broken\"} 2"));
        }
    }
}
