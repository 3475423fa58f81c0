//! The chat path's one surface onto the [`crate::store`]: find a record
//! (memory first, the store on a miss) and commit one (memory now, the
//! store in the background).

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

fn to_stored(r: &Record) -> StoredRecord {
    StoredRecord {
        k: r.k,
        prefix_hash: r.prefix_hash,
        replacement: r.replacement.iter().map(|m| m.get().to_owned()).collect(),
        original_tokens: r.original_tokens,
        replacement_tokens: r.replacement_tokens,
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
    Some(Record::new(
        s.k,
        s.prefix_hash,
        replacement,
        s.original_tokens,
        s.replacement_tokens,
    ))
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
        };
        assert!(from_stored(s).is_none());
    }
}
