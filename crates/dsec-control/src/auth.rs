//! API keys: generated on first start into a 0600 file, compared in constant time.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use rand::RngCore;

/// Loads the API key from `path`, creating a new random key there if the file is absent.
/// Returns the key and whether it was just created.
pub fn load_or_create_key(path: &Path) -> std::io::Result<(String, bool)> {
    match std::fs::read_to_string(path) {
        Ok(s) if !s.trim().is_empty() => return Ok((s.trim().to_string(), false)),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let mut bytes = [0u8; 24];
    rand::thread_rng().fill_bytes(&mut bytes);
    let key = format!(
        "dsec_{}",
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    );
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(key.as_bytes())?;
    f.write_all(b"\n")?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    Ok((key, true))
}

/// Constant-time comparison of two keys.
pub fn keys_equal(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn key_file_is_created_once_with_0600() {
        let dir = std::env::temp_dir().join(format!("dsec-auth-{}", std::process::id()));
        let path = dir.join("api-key");
        let _ = std::fs::remove_dir_all(&dir);
        let (k1, created) = load_or_create_key(&path).expect("create");
        assert!(created);
        assert!(k1.starts_with("dsec_") && k1.len() == 53);
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let (k2, created) = load_or_create_key(&path).expect("load");
        assert!(!created);
        assert_eq!(k1, k2);
        assert!(keys_equal(&k1, &k2));
        assert!(!keys_equal(&k1, "dsec_x"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
