//! A fixed-capacity byte ring that remembers the last `cap` bytes of a stream together with
//! the absolute offset of every byte, so readers can resume from an offset.
//!
//! Memory grows lazily up to `cap`, so small outputs cost little. Rings may share a
//! [`Budget`]: a ring that cannot get more bytes from it stops growing and keeps a
//! shorter tail.

use std::cell::Cell;
use std::rc::Rc;

/// Bytes that all the rings sharing it may hold together, except that each ring may
/// always hold its first `floor` bytes.
#[derive(Debug)]
pub struct Budget {
    limit: usize,
    floor: usize,
    held: Cell<usize>,
}

impl Budget {
    /// A budget of `limit` bytes, with `floor` bytes per ring granted whatever is held.
    pub fn new(limit: usize, floor: usize) -> Rc<Self> {
        Rc::new(Self {
            limit,
            floor,
            held: Cell::new(0),
        })
    }

    /// Bytes not yet held by any ring.
    pub fn available(&self) -> usize {
        self.limit.saturating_sub(self.held.get())
    }

    /// Bytes held by all rings together.
    pub fn held(&self) -> usize {
        self.held.get()
    }

    /// Grants up to `want` more bytes to a ring that holds `has`.
    fn take(&self, want: usize, has: usize) -> usize {
        let got = want.min(self.available().max(self.floor.saturating_sub(has)));
        self.held.set(self.held.get() + got);
        got
    }

    fn give(&self, n: usize) {
        self.held.set(self.held.get() - n);
    }
}

/// Bytes of a [`Budget`] held by one holder that is not a [`Ring`] (a session
/// command's output): given back when dropped.
#[derive(Debug)]
pub struct Lease {
    budget: Rc<Budget>,
    held: usize,
}

impl Lease {
    /// A lease of nothing yet on `budget`.
    pub fn new(budget: Rc<Budget>) -> Self {
        Self { budget, held: 0 }
    }

    /// Asks for a total of `want` bytes; answers the total held now (less than `want`
    /// when the budget is short, never less than its floor). Asking for less than is
    /// held gives the difference back.
    pub fn hold(&mut self, want: usize) -> usize {
        if want > self.held {
            self.held += self.budget.take(want - self.held, self.held);
        } else {
            self.budget.give(self.held - want);
            self.held = want;
        }
        self.held
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.budget.give(self.held);
    }
}

/// The last `cap` bytes written, plus the total count ever written.
#[derive(Debug)]
pub struct Ring {
    buf: Vec<u8>,
    cap: usize,
    /// Index of the oldest byte once `buf` is full; 0 while it is still growing.
    head: usize,
    total: u64,
    /// Where the bytes of `buf` are accounted.
    budget: Option<Rc<Budget>>,
}

impl Ring {
    /// An empty ring holding at most `cap` bytes.
    pub fn new(cap: usize) -> Self {
        Self {
            buf: Vec::new(),
            cap,
            head: 0,
            total: 0,
            budget: None,
        }
    }

    /// An empty ring holding at most `cap` bytes, and no more than `budget` grants.
    pub fn with_budget(cap: usize, budget: Rc<Budget>) -> Self {
        Self {
            buf: Vec::new(),
            cap,
            head: 0,
            total: 0,
            budget: Some(budget),
        }
    }

    /// Drops every byte held (they count as truncated) and holds none from now on.
    pub fn release(&mut self) {
        if let Some(b) = &self.budget {
            b.give(self.buf.len());
        }
        self.buf = Vec::new();
        self.cap = 0;
        self.head = 0;
    }

    /// Appends bytes, dropping the oldest ones beyond the capacity.
    pub fn push(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        if self.cap == 0 || data.is_empty() {
            return;
        }
        if let (Some(budget), true) = (&self.budget, self.buf.len() < self.cap) {
            // Still growing (head is 0): what it grows by comes from the budget; short
            // of it, the ring keeps the capacity it can have.
            let want = (self.cap - self.buf.len()).min(data.len());
            let got = budget.take(want, self.buf.len());
            if got < want {
                self.cap = self.buf.len() + got;
                if self.cap == 0 {
                    return;
                }
            }
        }
        if data.len() >= self.cap {
            data = &data[data.len() - self.cap..];
            self.buf.clear();
            self.buf.extend_from_slice(data);
            self.head = 0;
            return;
        }
        let free = self.cap - self.buf.len();
        if free > 0 {
            let n = free.min(data.len());
            self.buf.extend_from_slice(&data[..n]);
            data = &data[n..];
        }
        while !data.is_empty() {
            let n = (self.cap - self.head).min(data.len());
            self.buf[self.head..self.head + n].copy_from_slice(&data[..n]);
            self.head = (self.head + n) % self.cap;
            data = &data[n..];
        }
    }

    /// Total bytes ever pushed (the offset of the next byte).
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Offset of the oldest byte still held.
    pub fn start(&self) -> u64 {
        self.total - self.buf.len() as u64
    }

    /// True if bytes were dropped.
    pub fn truncated(&self) -> bool {
        self.start() > 0
    }

    /// The held bytes from absolute offset `from` (clamped into the held range), as up to
    /// two slices in order, and the offset where they actually start.
    pub fn slices_from(&self, from: u64) -> (u64, &[u8], &[u8]) {
        let start = self.start();
        let from = from.clamp(start, self.total);
        let skip = (from - start) as usize;
        let (a, b) = if self.buf.len() < self.cap || self.head == 0 {
            (&self.buf[..], &[][..])
        } else {
            (&self.buf[self.head..], &self.buf[..self.head])
        };
        if skip < a.len() {
            (from, &a[skip..], b)
        } else {
            (from, &b[skip - a.len()..], &[][..])
        }
    }

    /// Up to `max` bytes from offset `from` (clamped) as a new vector, and their offset.
    pub fn read_from(&self, from: u64, max: usize) -> (u64, Vec<u8>) {
        let (at, a, b) = self.slices_from(from);
        let mut out = Vec::with_capacity(max.min(a.len() + b.len()));
        let na = a.len().min(max);
        out.extend_from_slice(&a[..na]);
        let nb = b.len().min(max - na);
        out.extend_from_slice(&b[..nb]);
        (at, out)
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        if let Some(b) = &self.budget {
            b.give(self.buf.len());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rings_share_a_budget() {
        let budget = Budget::new(10, 0);
        let mut a = Ring::with_budget(8, budget.clone());
        a.push(b"abcdef");
        let mut b = Ring::with_budget(8, budget.clone());
        b.push(b"0123456789");
        // b got the 4 bytes left and keeps its last 4.
        assert_eq!(all(&b), b"6789");
        assert_eq!(b.start(), 6);
        assert_eq!(budget.available(), 0);
        a.push(b"gh");
        assert_eq!(all(&a), b"cdefgh", "a full budget: a keeps its size");
        a.release();
        assert!(all(&a).is_empty() && a.truncated());
        assert_eq!(a.total(), 8);
        assert_eq!(budget.available(), 6);
        b.push(b"xy");
        assert_eq!(all(&b), b"89xy", "b stays at the size it had");
        let mut c = Ring::with_budget(100, budget.clone());
        c.push(&[7; 50]);
        assert_eq!(all(&c).len(), 6);
        drop((b, c));
        assert_eq!(budget.held(), 0);
        let mut lease = Lease::new(budget.clone());
        assert_eq!(lease.hold(4), 4);
        assert_eq!(lease.hold(100), 10, "no more than the budget");
        assert_eq!(lease.hold(3), 3);
        assert_eq!(budget.available(), 7);
        drop(lease);
        assert_eq!(budget.held(), 0);
        // The floor: each ring keeps its first bytes whatever the others hold.
        let budget = Budget::new(4, 3);
        let mut a = Ring::with_budget(8, budget.clone());
        a.push(b"abcdefgh");
        assert_eq!(all(&a), b"efgh");
        let mut b = Ring::with_budget(8, budget.clone());
        b.push(b"0123456789");
        assert_eq!(all(&b), b"789");
        assert_eq!(budget.held(), 7);
    }

    fn all(r: &Ring) -> Vec<u8> {
        r.read_from(0, usize::MAX).1
    }

    #[test]
    fn keeps_last_bytes_and_offsets() {
        let mut r = Ring::new(5);
        r.push(b"abc");
        assert_eq!(all(&r), b"abc");
        assert!(!r.truncated());
        r.push(b"defg");
        assert_eq!(all(&r), b"cdefg");
        assert_eq!(r.start(), 2);
        assert_eq!(r.total(), 7);
        assert_eq!(r.read_from(4, 10), (4, b"efg".to_vec()));
        assert_eq!(r.read_from(0, 2), (2, b"cd".to_vec()));
        r.push(b"0123456789");
        assert_eq!(all(&r), b"56789");
        r.push(b"x");
        assert_eq!(all(&r), b"6789x");
        assert_eq!(r.read_from(100, 10), (18, Vec::new()));
        for _ in 0..13 {
            r.push(b"yz");
        }
        assert_eq!(all(&r), b"zyzyz");
        assert_eq!(r.total(), 44);
    }

    #[test]
    fn zero_capacity_counts_only() {
        let mut r = Ring::new(0);
        r.push(b"abc");
        assert_eq!(r.total(), 3);
        assert!(all(&r).is_empty());
    }
}
