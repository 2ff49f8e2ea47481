//! Finding a PJRT plugin, and the CUDA libraries a GPU plugin needs.
//!
//! A plugin is named by the `--pjrt-plugin` flag or the `MESHWORK_PJRT_PLUGIN`
//! environment variable; nothing is searched for behind the user's back. A GPU plugin
//! installed by pip (`jax-cuda13-pjrt`) sits in `site-packages/jax_plugins/…`, and the
//! CUDA libraries it links against in `site-packages/nvidia/*/lib` (the `nvidia-*`
//! wheels). As JAX's plugin loader does, meshwork loads those libraries first, so no
//! `LD_LIBRARY_PATH` is needed.

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The environment variable naming a plugin.
pub const ENV: &str = "MESHWORK_PJRT_PLUGIN";

/// The plugin to load: `flag` if given, else [`ENV`] if set and not empty, else
/// [`Error::NoPlugin`].
pub fn plugin_path(flag: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = flag {
        return Ok(p.to_owned());
    }
    match std::env::var_os(ENV) {
        Some(v) if !v.is_empty() => Ok(PathBuf::from(v)),
        _ => Err(Error::NoPlugin),
    }
}

/// The `nvidia/*/lib` folders beside the plugin's package (`site-packages/nvidia`),
/// sorted; empty when there are none (a CPU plugin, or CUDA installed system-wide).
pub fn cuda_library_dirs(plugin: &Path) -> Vec<PathBuf> {
    // site-packages/jax_plugins/xla_cuda13/xla_cuda_plugin.so → site-packages
    let Some(site) = plugin.parent().and_then(Path::parent).and_then(Path::parent) else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir(site.join("nvidia")) else {
        return Vec::new();
    };
    let mut dirs: Vec<PathBuf> =
        entries.flatten().map(|e| e.path().join("lib")).filter(|p| p.is_dir()).collect();
    dirs.sort();
    dirs
}

/// The shared libraries (`lib*.so*`) in `dirs`, sorted by path.
pub fn shared_libraries(dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut libs: Vec<PathBuf> = dirs
        .iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.starts_with("lib") && name.contains(".so")
        })
        .collect();
    libs.sort();
    libs
}

/// Loads `plugin` after the CUDA libraries beside it (if any) are loaded globally.
/// Before anything is mapped, the plugin and each of those libraries pass the ELF
/// pre-check ([`meshwork_io::elf`]): a truncated library would crash the process
/// with SIGBUS when `dlopen` maps it.
pub fn load(plugin: &Path) -> Result<crate::Plugin> {
    let explicit = crate::pjrt::as_written(plugin);
    meshwork_io::elf::check(&explicit)
        .map_err(|reason| Error::NotAPlugin { path: explicit.clone(), reason })?;
    let libs = shared_libraries(&cuda_library_dirs(&explicit));
    for lib in &libs {
        meshwork_io::elf::check(lib).map_err(|reason| Error::NotAPlugin {
            path: explicit.clone(),
            reason: format!("the CUDA library {} beside it: {reason}", lib.display()),
        })?;
    }
    if !libs.is_empty() {
        crate::pjrt::preload_global(&libs);
    }
    crate::Plugin::load(&explicit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flag_is_taken_as_given() {
        assert_eq!(plugin_path(Some(Path::new("/x.so"))).unwrap(), PathBuf::from("/x.so"));
    }

    #[test]
    fn cuda_libraries_are_found_beside_a_pip_installed_plugin() {
        let site = tempfile::tempdir().unwrap();
        let plugin = site.path().join("jax_plugins/xla_cuda13/xla_cuda_plugin.so");
        std::fs::create_dir_all(plugin.parent().unwrap()).unwrap();
        for (dir, lib) in [("cublas", "libcublas.so.13"), ("cuda_runtime", "libcudart.so.13")] {
            let d = site.path().join("nvidia").join(dir).join("lib");
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join(lib), b"").unwrap();
            std::fs::write(d.join("README"), b"").unwrap();
        }
        let dirs = cuda_library_dirs(&plugin);
        assert_eq!(dirs.len(), 2);
        let libs = shared_libraries(&dirs);
        let names: Vec<_> = libs.iter().map(|p| p.file_name().unwrap().to_owned()).collect();
        assert_eq!(names, ["libcublas.so.13", "libcudart.so.13"]);
        // A plugin with no nvidia folder beside it: nothing to preload.
        assert!(cuda_library_dirs(Path::new("/nonexistent/a/b/p.so")).is_empty());
    }
}
