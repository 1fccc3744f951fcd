use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How a child process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChildOutcome {
    Exited {
        code: Option<i32>,
        stdout: String,
        stderr: String,
    },
    /// Killed at the deadline, with what it had written.
    TimedOut { stdout: String, stderr: String },
}

/// Runs `command` with its output captured; kills it, and anything it started, if it runs
/// past `timeout`. A hung NCCL init cannot be interrupted from inside the process that hangs:
/// running each probe as a child is what bounds it.
pub fn run_bounded(mut command: Command, timeout: Duration) -> std::io::Result<ChildOutcome> {
    let mut child = command
        // Its own process group, so that the kill reaches its children too (they would hold
        // the output pipes open).
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    // Drain both pipes on threads so that a chatty child never blocks on a full pipe.
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_string(&mut text);
            }
            text
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if start.elapsed() > timeout {
            // SAFETY: signals the process group the child leads; no memory is involved.
            unsafe { libc::killpg(child.id() as libc::pid_t, libc::SIGKILL) };
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (stdout, stderr) = (stdout.join().unwrap_or_default(), stderr.join().unwrap_or_default());
    Ok(match status {
        Some(status) => ChildOutcome::Exited {
            code: status.code(),
            stdout,
            stderr,
        },
        None => ChildOutcome::TimedOut { stdout, stderr },
    })
}
