//! The Redis/Valkey backend: one store shared by every replica.
//!
//! Keys (under the `compactor:` prefix):
//! - `r:{cred}{hash}` a record's JSON, with `PX` = the idle TTL (renewed
//!   on use);
//! - `used` (sorted set, last use in ms), `meta` (hash: size and length of
//!   each record), `bytes` (their total), `lens` (hash: records per prefix
//!   length): the byte bound and the sweep, kept consistent by Lua scripts;
//! - `secret` the keyer secret (set once, `SET NX`, by the first replica);
//! - `w` (hash) learned windows; `s:{session}` conversation state (`PX`);
//! - `lock:{cred}{hash}` one compaction's lock (`SET NX PX`, released by
//!   its owner only, compare-and-delete).
//!
//! [`Store::may_have`] reads a local copy of the shortest record length
//! (refreshed by every sweep and every own write), so a passthrough turn of
//! a conversation shorter than any record costs no round trip. A find is
//! one script call that walks the current lengths on the server, so a
//! record another replica wrote a moment ago is found.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::resp::{Client, RedisUrl, Reply, RespError};
use super::{Store, StoreError, StoredRecord};

const PREFIX: &str = "compactor:";
/// Record uses remembered between two sweeps (beyond: the TTL renewal of
/// the rest waits for their next use through the store).
const MAX_TOUCHED: usize = 10_000;
/// Records one sweep call may drop.
const SWEEP_LIMIT: usize = 1000;
/// How long the start-up reads (the keyer secret, learned windows) may take.
const BOOT_TIMEOUT: Duration = Duration::from_secs(3);

const PUT: &str = r"
local p = ARGV[1]; local id = ARGV[2]
local old = redis.call('HGET', p..'meta', id)
if old then
  local s, k = string.match(old, '(%d+) (%d+)')
  redis.call('DECRBY', p..'bytes', s)
  if redis.call('HINCRBY', p..'lens', k, -1) <= 0 then redis.call('HDEL', p..'lens', k) end
end
redis.call('SET', p..'r:'..id, ARGV[7], 'PX', ARGV[5])
redis.call('HSET', p..'meta', id, ARGV[4]..' '..ARGV[3])
redis.call('INCRBY', p..'bytes', ARGV[4])
redis.call('HINCRBY', p..'lens', ARGV[3], 1)
redis.call('ZADD', p..'used', ARGV[6], id)
return 1
";

/// ARGV: prefix, cred, ttl, now, then the chain (element i = hash of
/// messages 1..=i).
const FIND: &str = r"
local p = ARGV[1]; local n = #ARGV - 4
local ks = {}
for _, f in ipairs(redis.call('HKEYS', p..'lens')) do
  local k = tonumber(f)
  if k and k >= 1 and k <= n then table.insert(ks, k) end
end
table.sort(ks, function(a, b) return a > b end)
for _, k in ipairs(ks) do
  local id = ARGV[2]..ARGV[4 + k]
  local v = redis.call('GET', p..'r:'..id)
  if v then
    redis.call('PEXPIRE', p..'r:'..id, ARGV[3])
    redis.call('ZADD', p..'used', ARGV[4], id)
    return v
  end
end
return false
";

/// ARGV: prefix, now, ttl, cutoff (now − ttl), max bytes, limit, then the
/// records used from memory since the last sweep. Returns the lengths.
const SWEEP: &str = r"
local p = ARGV[1]; local limit = tonumber(ARGV[6])
for i = 7, #ARGV do
  if redis.call('PEXPIRE', p..'r:'..ARGV[i], ARGV[3]) == 1 then
    redis.call('ZADD', p..'used', ARGV[2], ARGV[i])
  end
end
local function drop(id)
  local m = redis.call('HGET', p..'meta', id)
  if m then
    local s, k = string.match(m, '(%d+) (%d+)')
    redis.call('DECRBY', p..'bytes', s)
    if redis.call('HINCRBY', p..'lens', k, -1) <= 0 then redis.call('HDEL', p..'lens', k) end
    redis.call('HDEL', p..'meta', id)
  end
  redis.call('ZREM', p..'used', id)
  redis.call('DEL', p..'r:'..id)
end
local dropped = 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', p..'used', '-inf', ARGV[4], 'LIMIT', 0, limit)) do
  drop(id); dropped = dropped + 1
end
local max = tonumber(ARGV[5])
while dropped < limit and tonumber(redis.call('GET', p..'bytes') or '0') > max do
  local o = redis.call('ZRANGE', p..'used', 0, 0)
  if #o == 0 then break end
  drop(o[1]); dropped = dropped + 1
end
return redis.call('HKEYS', p..'lens')
";

const UNLOCK: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
";

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn id(cred: u128, hash: u128) -> String {
    format!("{cred:032x}{hash:032x}")
}

fn backend(e: RespError) -> StoreError {
    StoreError::Backend(e.to_string())
}

/// The rustls client configuration for `rediss://`: the same roots as the
/// upstream client (webpki and the system's).
fn tls_config() -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    for cert in rustls_native_certs::load_native_certs().certs {
        // A system certificate rustls cannot parse is skipped, as by the upstream client.
        let _ = roots.add(cert);
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap_or_else(|_| rustls::ClientConfig::builder());
    Arc::new(builder.with_root_certificates(roots).with_no_client_auth())
}

/// The Redis/Valkey store.
pub struct RedisStore {
    client: Arc<Client>,
    secret: Option<u64>,
    windows: Vec<(String, String, u64)>,
    /// Shortest record length in the store (`usize::MAX`: none known).
    min_len: AtomicUsize,
    /// Records used from memory since the last sweep (their TTL renewal).
    touched: Mutex<HashSet<String>>,
    ttl_ms: u64,
    max_bytes: usize,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("client", &self.client)
            .finish_non_exhaustive()
    }
}

/// What the start-up reads found.
struct Boot {
    secret: u64,
    windows: Vec<(String, String, u64)>,
    min_len: usize,
}

async fn boot(client: &Client) -> Result<Boot, RespError> {
    use std::hash::{BuildHasher, Hasher};
    let mine = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    let key = format!("{PREFIX}secret");
    // The first replica's secret wins; every other one reads it.
    client
        .call(&[b"SET", key.as_bytes(), mine.to_string().as_bytes(), b"NX"])
        .await?;
    let secret = client
        .call(&[b"GET", key.as_bytes()])
        .await?
        .into_bytes()
        .and_then(|b| String::from_utf8(b).ok()?.parse::<u64>().ok())
        .ok_or(RespError::Protocol("keyer secret is not a number"))?;
    let windows = client
        .call(&[b"HGETALL", format!("{PREFIX}w").as_bytes()])
        .await?
        .into_array();
    let windows = windows
        .chunks(2)
        .filter_map(|kv| {
            let field = String::from_utf8(kv.first()?.clone().into_bytes()?).ok()?;
            let tokens = u64::try_from(kv.get(1)?.as_int()?).ok()?;
            let (u, m) = field.split_once('\0')?;
            Some((u.to_owned(), m.to_owned(), tokens))
        })
        .collect();
    let lens = client
        .call(&[b"HKEYS", format!("{PREFIX}lens").as_bytes()])
        .await?;
    Ok(Boot {
        secret,
        windows,
        min_len: shortest(lens),
    })
}

fn shortest(lens: Reply) -> usize {
    lens.into_array()
        .iter()
        .filter_map(Reply::as_int)
        .filter_map(|k| usize::try_from(k).ok())
        .filter(|k| *k >= 1)
        .min()
        .unwrap_or(usize::MAX)
}

impl RedisStore {
    /// Connects to `url` and reads the keyer secret and learned windows
    /// (blocking, at start-up, on a thread of its own). A Redis that cannot
    /// be reached then still gives a store: it is used once it answers,
    /// but this process keys credentials with its own secret (its records
    /// are then not found by other replicas).
    pub fn open(url: &str, ttl: Duration, max_bytes: usize) -> Result<Self, StoreError> {
        let url = RedisUrl::parse(url).map_err(backend)?;
        let tls = url.tls.then(tls_config);
        let client = Arc::new(Client::new(url, tls));
        let booted = {
            let client = Arc::clone(&client);
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| StoreError::Backend(e.to_string()))?;
                let out = rt.block_on(async {
                    match tokio::time::timeout(BOOT_TIMEOUT, boot(&client)).await {
                        Ok(r) => r.map_err(backend),
                        Err(_) => Err(StoreError::Timeout),
                    }
                });
                // Its connections belong to this runtime's reactor.
                client.clear_idle();
                out
            })
            .join()
            .map_err(|_| StoreError::Backend("start-up thread panicked".into()))?
        };
        let (secret, windows, min_len) = match booted {
            Ok(b) => (Some(b.secret), b.windows, b.min_len),
            Err(e) => {
                tracing::warn!(backend = "redis", error = %e,
                    "redis unreachable at start; using it once it answers, with this process's own keyer secret");
                // Unknown lengths: a lookup asks the store.
                (None, Vec::new(), 1)
            }
        };
        Ok(Self {
            client,
            secret,
            windows,
            min_len: AtomicUsize::new(min_len),
            touched: Mutex::new(HashSet::new()),
            ttl_ms: u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1),
            max_bytes: max_bytes.max(1),
        })
    }

    async fn eval(&self, script: &str, keys: &[&[u8]], args: &[&[u8]]) -> Result<Reply, RespError> {
        let n = keys.len().to_string();
        let mut all: Vec<&[u8]> = vec![b"EVAL", script.as_bytes(), n.as_bytes()];
        all.extend_from_slice(keys);
        all.extend_from_slice(args);
        self.client.call(&all).await
    }
}

#[async_trait::async_trait]
impl Store for RedisStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn shared(&self) -> bool {
        true
    }

    fn keyer_secret(&self) -> Option<u64> {
        self.secret
    }

    fn may_have(&self, len: usize) -> bool {
        self.min_len.load(Ordering::Relaxed) <= len
    }

    fn touch(&self, cred: u128, prefix_hash: u128) {
        let mut t = crate::sync::lock(&self.touched);
        if t.len() < MAX_TOUCHED {
            t.insert(id(cred, prefix_hash));
        }
    }

    async fn find(&self, cred: u128, hashes: &[u128]) -> Result<Option<StoredRecord>, StoreError> {
        if hashes.is_empty() {
            return Ok(None);
        }
        let head = [
            PREFIX.to_owned(),
            format!("{cred:032x}"),
            self.ttl_ms.to_string(),
            now_ms().to_string(),
        ];
        let chain: Vec<String> = hashes.iter().map(|h| format!("{h:032x}")).collect();
        let args: Vec<&[u8]> = head.iter().chain(&chain).map(|s| s.as_bytes()).collect();
        let Some(bytes) = self
            .eval(FIND, &[], &args)
            .await
            .map_err(backend)?
            .into_bytes()
        else {
            return Ok(None);
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|_| StoreError::Corrupt)
    }

    async fn put(&self, cred: u128, record: StoredRecord) -> Result<(), StoreError> {
        let size = record.size();
        if size > self.max_bytes {
            return Ok(());
        }
        let json = serde_json::to_vec(&record).map_err(|e| StoreError::Backend(e.to_string()))?;
        let args = [
            PREFIX.to_owned(),
            id(cred, record.prefix_hash),
            record.k.to_string(),
            size.to_string(),
            self.ttl_ms.to_string(),
            now_ms().to_string(),
        ];
        let mut argv: Vec<&[u8]> = args.iter().map(|s| s.as_bytes()).collect();
        argv.push(&json);
        self.eval(PUT, &[], &argv).await.map_err(backend)?;
        self.min_len.fetch_min(record.k.max(1), Ordering::Relaxed);
        Ok(())
    }

    async fn sweep(&self) -> Result<(), StoreError> {
        let touched: Vec<String> = crate::sync::lock(&self.touched).drain().collect();
        let now = now_ms();
        let head = [
            PREFIX.to_owned(),
            now.to_string(),
            self.ttl_ms.to_string(),
            now.saturating_sub(self.ttl_ms).to_string(),
            self.max_bytes.to_string(),
            SWEEP_LIMIT.to_string(),
        ];
        let args: Vec<&[u8]> = head.iter().chain(&touched).map(|s| s.as_bytes()).collect();
        let lens = self.eval(SWEEP, &[], &args).await.map_err(backend)?;
        self.min_len.store(shortest(lens), Ordering::Relaxed);
        Ok(())
    }

    fn windows(&self) -> Vec<(String, String, u64)> {
        self.windows.clone()
    }

    async fn put_window(&self, upstream: &str, model: &str, tokens: u64) -> Result<(), StoreError> {
        let field = format!("{upstream}\0{model}");
        self.client
            .call(&[
                b"HSET",
                format!("{PREFIX}w").as_bytes(),
                field.as_bytes(),
                tokens.to_string().as_bytes(),
            ])
            .await
            .map_err(backend)?;
        Ok(())
    }

    async fn try_lock(
        &self,
        cred: u128,
        prefix_hash: u128,
        token: u64,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let key = format!("{PREFIX}lock:{}", id(cred, prefix_hash));
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let reply = self
            .client
            .call(&[
                b"SET",
                key.as_bytes(),
                token.to_string().as_bytes(),
                b"NX",
                b"PX",
                ms.to_string().as_bytes(),
            ])
            .await
            .map_err(backend)?;
        Ok(matches!(reply, Reply::Simple(_)))
    }

    async fn unlock(&self, cred: u128, prefix_hash: u128, token: u64) -> Result<(), StoreError> {
        let key = format!("{PREFIX}lock:{}", id(cred, prefix_hash));
        self.eval(UNLOCK, &[key.as_bytes()], &[token.to_string().as_bytes()])
            .await
            .map_err(backend)?;
        Ok(())
    }

    async fn get_state(&self, session: u128) -> Result<Option<Vec<u8>>, StoreError> {
        let key = format!("{PREFIX}s:{session:032x}");
        Ok(self
            .client
            .call(&[b"GET", key.as_bytes()])
            .await
            .map_err(backend)?
            .into_bytes())
    }

    async fn put_state(&self, session: u128, state: Vec<u8>) -> Result<(), StoreError> {
        let key = format!("{PREFIX}s:{session:032x}");
        self.client
            .call(&[
                b"SET",
                key.as_bytes(),
                &state,
                b"PX",
                self.ttl_ms.to_string().as_bytes(),
            ])
            .await
            .map_err(backend)?;
        Ok(())
    }
}
