//! A writer of `newc` cpio archives, the format the kernel unpacks as an initramfs.
//! Archives can be concatenated: the kernel unpacks each in turn, later files over
//! earlier ones.

use std::io::{self, Write};

/// Writes a newc archive entry by entry; [`Cpio::finish`] adds the trailer.
#[derive(Debug)]
pub struct Cpio<W: Write> {
    out: W,
    written: u64,
    ino: u32,
}

impl<W: Write> Cpio<W> {
    /// Starts an archive on `out`.
    pub fn new(out: W) -> Self {
        Self {
            out,
            written: 0,
            ino: 1,
        }
    }

    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) -> io::Result<()> {
        self.entry_rdev(name, mode, (0, 0), data)
    }

    fn entry_rdev(
        &mut self,
        name: &str,
        mode: u32,
        (rdevmajor, rdevminor): (u32, u32),
        data: &[u8],
    ) -> io::Result<()> {
        let name = name.trim_start_matches('/');
        let ino = self.ino;
        self.ino += 1;
        let nlink = if mode & 0o170000 == 0o040000 { 2 } else { 1 };
        let header = format!(
            "070701{ino:08x}{mode:08x}{uid:08x}{gid:08x}{nlink:08x}{mtime:08x}{size:08x}\
             {devmajor:08x}{devminor:08x}{rdevmajor:08x}{rdevminor:08x}{namesize:08x}{check:08x}",
            uid = 0,
            gid = 0,
            mtime = 0,
            size = data.len(),
            devmajor = 0,
            devminor = 0,
            namesize = name.len() + 1,
            check = 0,
        );
        self.put(header.as_bytes())?;
        self.put(name.as_bytes())?;
        self.put(&[0])?;
        self.pad()?;
        self.put(data)?;
        self.pad()
    }

    fn put(&mut self, b: &[u8]) -> io::Result<()> {
        self.out.write_all(b)?;
        self.written += b.len() as u64;
        Ok(())
    }

    fn pad(&mut self) -> io::Result<()> {
        let rem = (4 - (self.written % 4) as usize) % 4;
        self.put(&[0u8; 3][..rem])
    }

    /// Adds a directory (its parents must come first).
    pub fn dir(&mut self, name: &str) -> io::Result<()> {
        self.entry(name, 0o040755, &[])
    }

    /// Adds a regular file with permission bits `perm`.
    pub fn file(&mut self, name: &str, perm: u32, data: &[u8]) -> io::Result<()> {
        self.entry(name, 0o100000 | (perm & 0o7777), data)
    }

    /// Adds a character device node (`perm` bits, device `major:minor`).
    pub fn char_dev(&mut self, name: &str, perm: u32, major: u32, minor: u32) -> io::Result<()> {
        self.entry_rdev(name, 0o020000 | (perm & 0o7777), (major, minor), &[])
    }

    /// Writes the trailer and returns the output.
    pub fn finish(mut self) -> io::Result<W> {
        self.entry("TRAILER!!!", 0, &[])?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpio_tool_reads_what_we_write() {
        // The cpio tool is in the test packages (scripts/lib.sh).
        let out = std::process::Command::new("cpio")
            .arg("--version")
            .output()
            .expect("cpio (apt-get install cpio)");
        assert!(out.status.success());
        let mut c = Cpio::new(Vec::new());
        c.dir("a").expect("test step");
        c.file("a/b.txt", 0o644, b"hello").expect("test step");
        c.file("/c", 0o755, b"xyz12").expect("test step");
        let bytes = c.finish().expect("test step");
        assert_eq!(bytes.len() % 4, 0);
        let dir = tempfile::tempdir().expect("test step");
        let mut child = std::process::Command::new("cpio")
            .args(["-idm", "--quiet"])
            .current_dir(dir.path())
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("test step");
        child
            .stdin
            .take()
            .expect("test step")
            .write_all(&bytes)
            .expect("test step");
        assert!(child.wait().expect("test step").success());
        assert_eq!(
            std::fs::read(dir.path().join("a/b.txt")).expect("test step"),
            b"hello"
        );
        use std::os::unix::fs::PermissionsExt;
        let meta = std::fs::metadata(dir.path().join("c")).expect("test step");
        assert_eq!(meta.permissions().mode() & 0o777, 0o755);
    }
}
