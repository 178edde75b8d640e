//! API key strings: `dsec_<key_id>_<secret>`, their generation, parsing and hashing.
//!
//! The key id (12 characters of `[a-z2-7]`, 60 random bits) is public: it names the key
//! in listings and logs. The secret is 32 random bytes from the OS, in hex. Only the
//! SHA-256 of the secret is stored; a presented secret's hash is compared in constant
//! time. (A fast hash is enough: the secret has 256 bits of entropy, so there is nothing
//! to brute-force, unlike a password.)

use rand::RngCore;
use sha2::{Digest, Sha256};

/// The prefix of every key.
pub const KEY_PREFIX: &str = "dsec_";
/// Length of a key id.
pub const KEY_ID_LEN: usize = 12;
const SECRET_BYTES: usize = 32;
const ID_ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";

/// The SHA-256 of a secret.
pub(crate) type Hash = [u8; 32];

pub(crate) fn sha256(bytes: &[u8]) -> Hash {
    Sha256::digest(bytes).into()
}

/// A fresh key: `(key_id, whole key, hash of its secret)`.
pub(crate) fn generate() -> (String, String, Hash) {
    generate_with(KEY_PREFIX)
}

/// A fresh secret of the key shape under `prefix` (API keys, model gateway tokens).
pub(crate) fn generate_with(prefix: &str) -> (String, String, Hash) {
    let mut rng = rand::rngs::OsRng;
    let mut id_bytes = [0u8; KEY_ID_LEN];
    rng.fill_bytes(&mut id_bytes);
    let key_id: String = id_bytes
        .iter()
        .map(|b| char::from(ID_ALPHABET[usize::from(b & 31)]))
        .collect();
    let mut secret = [0u8; SECRET_BYTES];
    rng.fill_bytes(&mut secret);
    let secret = hex::encode(secret);
    let hash = sha256(secret.as_bytes());
    (key_id.clone(), format!("{prefix}{key_id}_{secret}"), hash)
}

/// Whether `id` has the shape of a key id.
pub fn valid_key_id(id: &str) -> bool {
    id.len() == KEY_ID_LEN && id.bytes().all(|b| ID_ALPHABET.contains(&b))
}

/// Splits a presented key into its id and secret; `None` if it is not shaped like one.
pub(crate) fn parse(key: &str) -> Option<(&str, &str)> {
    parse_with(KEY_PREFIX, key)
}

/// [`parse`] of a secret under `prefix`.
pub(crate) fn parse_with<'k>(prefix: &str, key: &'k str) -> Option<(&'k str, &'k str)> {
    let (id, secret) = key.strip_prefix(prefix)?.split_once('_')?;
    let secret_ok =
        secret.len() == 2 * SECRET_BYTES && secret.bytes().all(|b| b.is_ascii_hexdigit());
    (valid_key_id(id) && secret_ok).then_some((id, secret))
}

/// Compares two hashes in time independent of where they differ.
pub(crate) fn ct_eq(a: &Hash, b: &Hash) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_keys_parse_and_hash() {
        let (id, key, hash) = generate();
        assert!(valid_key_id(&id), "{id}");
        let (pid, secret) = parse(&key).expect("parses");
        assert_eq!(pid, id);
        assert!(ct_eq(&sha256(secret.as_bytes()), &hash));
        assert!(!ct_eq(&sha256(b"other"), &hash));
        let (id2, key2, _) = generate();
        assert_ne!((id, key), (id2, key2));
    }

    #[test]
    fn malformed_keys_do_not_parse() {
        let (_, key, _) = generate();
        for bad in [
            "",
            "dsec_",
            "secret",
            &key[1..],
            &key[..key.len() - 1],
            &key.replace("dsec_", "dsex_"),
            &format!("{key}0"),
            &key.to_uppercase(),
        ] {
            assert!(parse(bad).is_none(), "{bad:?}");
        }
    }
}
