//! The one rule for files that hold a secret (keys, passwords, tokens, a
//! configuration with a password in it): libpq's rule for its key file. Readable by
//! its owner only (0600 or less), or also by its group when root owns it (0640 or
//! less: root-owned files a service's group may read, as a package or a Kubernetes
//! secret volume with `fsGroup` lays them out). docs/security.md, "Secrets from
//! files".

/// The file's permission bits when they break the rule (group or world access
/// beyond it), `None` when they keep it.
#[cfg(unix)]
pub fn too_open(meta: &std::fs::Metadata) -> Option<u32> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let mode = meta.permissions().mode() & 0o777;
    let forbidden = if meta.uid() == 0 { 0o037 } else { 0o077 };
    (mode & forbidden != 0).then_some(mode)
}

/// No permission bits to check off Unix.
#[cfg(not(unix))]
pub fn too_open(_meta: &std::fs::Metadata) -> Option<u32> {
    None
}

/// What the rule allows, for messages.
pub const ALLOWED: &str = "u=rw (0600) or less, or u=rw,g=r (0640) or less when owned by root";

#[cfg(all(test, unix))]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn owner_only_or_group_read_when_root_owns_it() {
        let path = std::env::temp_dir().join(format!("secret-file-{}", std::process::id()));
        std::fs::write(&path, "s").unwrap();
        let root = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&path).unwrap()) == 0;
        for (mode, open_for_root, open_for_others) in [
            (0o600, false, false),
            (0o400, false, false),
            (0o640, false, true),
            (0o440, false, true),
            (0o660, true, true),
            (0o644, true, true),
            (0o604, true, true),
        ] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            let got = too_open(&std::fs::metadata(&path).unwrap());
            let expected = if root { open_for_root } else { open_for_others };
            assert_eq!(got.is_some(), expected, "mode {mode:o}");
        }
        let _ = std::fs::remove_file(&path);
    }
}
