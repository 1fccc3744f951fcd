//! Output files, written so that a failed run leaves nothing behind: the path is checked
//! before the run; the bytes go to a temporary file beside the target, created with the mode
//! a plain create gives (the umask's), synced, then renamed over it. Only a regular file is
//! replaced; a symbolic link is followed to the file it names.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// Fails, naming `flag` and the path, where `path` (or the file a link there names) is
/// anything but a regular file or a new name in a writable folder.
pub fn check(flag: &str, path: &Path) -> Result<()> {
    let target = target(flag, path)?;
    temporary(&target).with_context(|| {
        format!(
            "{flag} {}: cannot write into {}; choose a folder that exists and is writable",
            path.display(),
            folder(&target).display()
        )
    })?;
    Ok(())
}

/// The file a link at `path` names, or `path`; refused where it is not a regular file.
fn target(flag: &str, path: &Path) -> Result<PathBuf> {
    let target = match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_symlink() => std::fs::canonicalize(path)
            .with_context(|| format!("{flag} {}: the link names nothing that exists", path.display()))?,
        Ok(_) | Err(_) => path.to_path_buf(),
    };
    if let Ok(meta) = std::fs::metadata(&target) {
        if !meta.is_file() {
            bail!(
                "{flag} {}: it is {}, not a regular file; give a file's path",
                path.display(),
                if meta.is_dir() {
                    "a directory"
                } else {
                    "a device or special file"
                }
            );
        }
    }
    Ok(target)
}

/// Writes `path` (refused as [`check`] refuses it) through `write`, which fills the temporary
/// file at the path it is given. The temporary file is the writability check.
pub fn write(flag: &str, path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let target = target(flag, path)?;
    let temp =
        temporary(&target).with_context(|| format!("{flag} {}: cannot create a file beside it", path.display()))?;
    let mode = temp.as_file().metadata().map(|m| m.permissions());
    write(temp.path()).with_context(|| format!("{flag} {}: writing failed", path.display()))?;
    // Writers may replace the file at the path (safetensors does, with a private mode): the
    // mode is set, and the data synced, on whatever file is there now.
    let written = std::fs::File::open(temp.path()).and_then(|file| {
        if let Ok(mode) = mode {
            file.set_permissions(mode)?;
        }
        file.sync_all()
    });
    written.with_context(|| format!("{flag} {}: syncing failed", path.display()))?;
    temp.persist(&target)
        .with_context(|| format!("{flag} {}: cannot rename the written file into place", path.display()))?;
    Ok(())
}

fn folder(path: &Path) -> &Path {
    match path.parent() {
        Some(folder) if !folder.as_os_str().is_empty() => folder,
        _ => Path::new("."),
    }
}

/// A temporary file in `path`'s folder, with the mode a plain create would give it.
fn temporary(path: &Path) -> std::io::Result<tempfile::NamedTempFile> {
    let mut builder = tempfile::Builder::new();
    builder.prefix(".tpinfer-");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        // Masked by the umask on creation, as `File::create`'s 0o666 is.
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    builder.tempfile_in(folder(path))
}

/// Fails, naming `flag` and the path, where `dir` is neither a new name in a writable folder
/// nor an empty directory: the files written there replace nothing.
pub fn check_dir(flag: &str, dir: &Path) -> Result<()> {
    if let Ok(meta) = std::fs::metadata(dir) {
        if !meta.is_dir() {
            bail!(
                "{flag} {}: it is not a directory; give a new or empty directory",
                dir.display()
            );
        }
        let mut entries =
            std::fs::read_dir(dir).with_context(|| format!("{flag} {}: cannot read the directory", dir.display()))?;
        if entries.next().is_some() {
            bail!(
                "{flag} {}: the directory is not empty; give a new or empty one, so that no frame of another \
                 video stays among these",
                dir.display()
            );
        }
    }
    temporary_dir(dir).with_context(|| {
        format!(
            "{flag} {}: cannot write into {}; choose a folder that exists and is writable",
            dir.display(),
            folder(dir).display()
        )
    })?;
    Ok(())
}

/// Fills a new directory at `dir` (refused as [`check_dir`] refuses it) through `write`, which
/// writes into the temporary directory it is given; it is renamed into place only when every
/// file is written and synced.
pub fn write_dir(flag: &str, dir: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    check_dir(flag, dir)?;
    let temp =
        temporary_dir(dir).with_context(|| format!("{flag} {}: cannot create a folder beside it", dir.display()))?;
    write(temp.path()).with_context(|| format!("{flag} {}: writing failed", dir.display()))?;
    let synced = std::fs::read_dir(temp.path()).and_then(|entries| {
        for entry in entries {
            std::fs::File::open(entry?.path())?.sync_all()?;
        }
        Ok(())
    });
    synced.with_context(|| format!("{flag} {}: syncing failed", dir.display()))?;
    if dir.is_dir() {
        // Empty, as checked: the new folder takes its place.
        std::fs::remove_dir(dir)
            .with_context(|| format!("{flag} {}: cannot replace the empty folder", dir.display()))?;
    }
    let temp = temp.keep();
    if let Err(e) = std::fs::rename(&temp, dir) {
        let _ = std::fs::remove_dir_all(&temp);
        return Err(e)
            .with_context(|| format!("{flag} {}: cannot rename the written folder into place", dir.display()));
    }
    Ok(())
}

/// A temporary directory in `dir`'s folder, with the mode a plain create would give it.
fn temporary_dir(dir: &Path) -> std::io::Result<tempfile::TempDir> {
    let mut builder = tempfile::Builder::new();
    builder.prefix(".tpinfer-");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        // Masked by the umask on creation, as `create_dir`'s 0o777 is.
        builder.permissions(std::fs::Permissions::from_mode(0o777));
    }
    builder.tempdir_in(folder(dir))
}
