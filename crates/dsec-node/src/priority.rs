//! CPU priority of the node's own threads: teardown yields to creates.
//!
//! A delete's work (killing the sandbox, unmounting, removing cgroups, resetting its
//! disk) is not what anyone waits on in a busy node; a create is. While a thread holds a
//! [`Background`] guard the scheduler runs it only when creates leave CPU over, so a
//! burst of deletes does not push time to interactive up. Linux keeps the nice value per
//! thread, so the rest of the process is unaffected.

/// The nice value of background work: the lowest CFS weight short of `SCHED_IDLE`, so a
/// backlog still drains on a saturated node.
pub const BACKGROUND_NICE: libc::c_int = 19;

/// Runs the current thread at [`BACKGROUND_NICE`] until dropped, then restores its nice
/// value. Failing to change priority is not an error (the work just runs at the normal
/// priority).
#[derive(Debug)]
pub struct Background {
    restore: Option<libc::c_int>,
}

fn thread_id() -> libc::id_t {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() as libc::id_t }
}

impl Background {
    /// Lowers the calling thread's priority.
    pub fn enter() -> Self {
        let tid = thread_id();
        // getpriority may return -1 legitimately; errno tells. Nice values here are never
        // negative in practice, but do it properly.
        // SAFETY: errno location is thread-local; getpriority/setpriority take plain ints.
        let before = unsafe {
            *libc::__errno_location() = 0;
            let p = libc::getpriority(libc::PRIO_PROCESS, tid);
            (*libc::__errno_location() == 0).then_some(p)
        };
        // SAFETY: setpriority on our own thread id.
        let lowered = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, BACKGROUND_NICE) } == 0;
        Self {
            restore: before.filter(|_| lowered),
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(nice) = self.restore {
            // Raising the priority again needs CAP_SYS_NICE (the node runs as root).
            // SAFETY: setpriority on our own thread id.
            unsafe { libc::setpriority(libc::PRIO_PROCESS, thread_id(), nice) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nice_now() -> libc::c_int {
        // SAFETY: plain getpriority on this thread.
        unsafe { libc::getpriority(libc::PRIO_PROCESS, thread_id()) }
    }

    #[test]
    fn background_lowers_this_thread_only_and_restores() {
        let before = nice_now();
        let other = std::thread::spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(50));
            nice_now()
        });
        {
            let _bg = Background::enter();
            assert_eq!(nice_now(), BACKGROUND_NICE);
            let stat = std::fs::read_to_string(format!("/proc/self/task/{}/stat", thread_id()))
                .expect("thread stat");
            let nice_field: i32 = stat[stat.rfind(')').expect("comm") + 2..]
                .split_whitespace()
                .nth(19 - 3)
                .and_then(|f| f.parse().ok())
                .expect("nice field");
            assert_eq!(
                nice_field, BACKGROUND_NICE,
                "the kernel sees the thread's nice"
            );
            assert_eq!(
                other.join().expect("join"),
                before,
                "other threads keep theirs"
            );
        }
        assert_eq!(nice_now(), before);
    }
}
