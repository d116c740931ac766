//! Path confinement: every path an agent names must lie inside the session's roots (its `cwd`
//! and `additionalDirectories`) after resolving symlinks.

use std::path::{Component, Path, PathBuf};

/// Why a path was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PathError {
    /// ACP paths must be absolute.
    #[error("path {0} is not absolute")]
    NotAbsolute(String),
    /// `..` after a component that does not exist cannot be resolved safely.
    #[error("path {0} has `..` after a missing component")]
    Unresolvable(String),
    /// The resolved path is outside every session root.
    #[error("path {path} resolves to {resolved}, outside the session roots")]
    OutsideRoots {
        /// The path as given.
        path: String,
        /// Where it resolves.
        resolved: String,
    },
    /// Resolving failed (for example a dangling symlink or a permission error).
    #[error("cannot resolve path {path}: {reason}")]
    Io {
        /// The path as given.
        path: String,
        /// The OS error.
        reason: String,
    },
}

/// Canonicalizes a session root (must exist and be a directory).
pub fn canonical_root(dir: &Path) -> Result<PathBuf, String> {
    if !dir.is_absolute() {
        return Err("not an absolute path".into());
    }
    let c = std::fs::canonicalize(dir).map_err(|e| e.to_string())?;
    if !c.is_dir() {
        return Err("not a directory".into());
    }
    Ok(c)
}

/// Resolves `path` (which may not exist yet) by canonicalizing its longest existing ancestor and
/// appending the rest, which must consist of plain names only.
pub fn resolve(path: &Path) -> Result<PathBuf, PathError> {
    let shown = || path.display().to_string();
    if !path.is_absolute() {
        return Err(PathError::NotAbsolute(shown()));
    }
    let mut existing = path.to_path_buf();
    let mut rest: Vec<std::ffi::OsString> = Vec::new();
    loop {
        match std::fs::symlink_metadata(&existing) {
            Ok(_) => break,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let name = existing.file_name().map(|n| n.to_os_string());
                // `..` or `.` as the last component of a missing path: refuse rather than guess.
                match existing.components().next_back() {
                    Some(Component::Normal(_)) => {}
                    _ => return Err(PathError::Unresolvable(shown())),
                }
                let Some(name) = name else {
                    return Err(PathError::Unresolvable(shown()));
                };
                rest.push(name);
                if !existing.pop() {
                    return Err(PathError::Unresolvable(shown()));
                }
            }
            Err(e) => {
                return Err(PathError::Io {
                    path: shown(),
                    reason: e.to_string(),
                });
            }
        }
    }
    // Components of the missing tail must all be plain names.
    for part in &rest {
        let p = Path::new(part);
        if !matches!(p.components().next(), Some(Component::Normal(_))) {
            return Err(PathError::Unresolvable(shown()));
        }
    }
    let mut resolved = std::fs::canonicalize(&existing).map_err(|e| PathError::Io {
        path: shown(),
        reason: e.to_string(),
    })?;
    for part in rest.iter().rev() {
        resolved.push(part);
    }
    Ok(resolved)
}

/// Resolves `path` and checks it lies inside one of `roots` (already canonical).
pub fn confine(path: &Path, roots: &[PathBuf]) -> Result<PathBuf, PathError> {
    let resolved = resolve(path)?;
    if roots.iter().any(|r| resolved.starts_with(r)) {
        Ok(resolved)
    } else {
        Err(PathError::OutsideRoots {
            path: path.display().to_string(),
            resolved: resolved.display().to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confinement_rules() {
        let dir = tempfile::tempdir().unwrap();
        let root = canonical_root(dir.path()).unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "x").unwrap();
        std::fs::create_dir(root.join("sub")).unwrap();
        std::fs::write(root.join("sub/a.txt"), "a").unwrap();
        #[cfg(unix)]
        std::os::unix::fs::symlink(outside.path(), root.join("escape")).unwrap();
        let roots = vec![root.clone()];

        assert_eq!(
            confine(&root.join("sub/a.txt"), &roots).unwrap(),
            root.join("sub/a.txt")
        );
        // A new file in a new directory is fine.
        assert_eq!(
            confine(&root.join("new/dir/f.txt"), &roots).unwrap(),
            root.join("new/dir/f.txt")
        );
        // `..` that stays inside is resolved.
        assert_eq!(
            confine(&root.join("sub/../sub/a.txt"), &roots).unwrap(),
            root.join("sub/a.txt")
        );
        assert!(matches!(
            confine(&root.join("sub/../../x"), &roots),
            Err(PathError::OutsideRoots { .. })
        ));
        assert!(matches!(
            confine(&root.join("missing/../../x"), &roots),
            Err(PathError::Unresolvable(_))
        ));
        assert!(matches!(
            confine(Path::new("relative.txt"), &roots),
            Err(PathError::NotAbsolute(_))
        ));
        assert!(matches!(
            confine(&outside.path().join("secret"), &roots),
            Err(PathError::OutsideRoots { .. })
        ));
        #[cfg(unix)]
        {
            assert!(matches!(
                confine(&root.join("escape/secret"), &roots),
                Err(PathError::OutsideRoots { .. })
            ));
            assert!(matches!(
                confine(&root.join("escape/new.txt"), &roots),
                Err(PathError::OutsideRoots { .. })
            ));
        }
    }
}
