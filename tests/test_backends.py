"""Why the CUDA backend is unavailable, as `available_backends` reports it: a source tree
without the extension that shadows an installed copy with it, a build missing everywhere, a
build that fails to load; and the triton backend's reason on a machine without a GPU. Fake
package folders under tmp_path stand in for the installed copies (nothing is imported)."""
import importlib.machinery
import sys

import pytest

from kd_kernels import backends

EDITABLE_INSTALL = 'KD_KERNELS_BUILD_CUDA=1 python -m pip install --no-build-isolation -e ".[triton]"'
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _package(root, with_extension: bool):
    package = root / "kd_kernels"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    if with_extension:
        (package / f"_C{SUFFIX}").write_bytes(b"")
    return package


@pytest.fixture
def source_tree(tmp_path, monkeypatch):
    """A source tree's kd_kernels without the extension; sys.path holds only the folders a test adds."""
    monkeypatch.setattr(sys, "path", [])
    return _package(tmp_path / "repo", with_extension=False)


def test_an_installed_copy_with_the_extension_is_named_beside_the_source_tree(tmp_path, monkeypatch, source_tree):
    site = tmp_path / "site-packages"
    installed = _package(site, with_extension=True)
    info = site / "kd_kernels-0.1.0.dist-info"  # what pip records: importlib.metadata finds the file from it
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kd_kernels\nVersion: 0.1.0\n")
    (info / "RECORD").write_text(f"kd_kernels/__init__.py,,\nkd_kernels/_C{SUFFIX},,\n")
    monkeypatch.setattr(sys, "path", [str(source_tree.parent), str(site)])
    reason = backends._extension_missing_reason(str(source_tree), ImportError("cannot import name '_C'"))
    assert reason == (f"the kd_kernels imported ({source_tree}) has no CUDA extension, but an installed kd_kernels "
                      f"has it ({(installed / f'_C{SUFFIX}').resolve()}): this source tree shadows the installed "
                      f"package. Run from another directory, or build the extension in place with the editable "
                      f"install: {EDITABLE_INSTALL}")


def test_a_copy_found_on_sys_path_alone_is_named_too(tmp_path, monkeypatch, source_tree):
    other = _package(tmp_path / "elsewhere", with_extension=True)  # no metadata: found as a folder on sys.path
    monkeypatch.setattr(sys, "path", [str(tmp_path / "elsewhere")])
    assert backends._installed_extensions_elsewhere(str(source_tree)) == [str((other / f"_C{SUFFIX}").resolve())]
    assert backends._installed_extensions_elsewhere(str(other)) == []  # its own build is not "elsewhere"


def test_no_build_anywhere_says_how_to_build_it(tmp_path, monkeypatch, source_tree):
    _package(tmp_path / "site-packages", with_extension=False)
    monkeypatch.setattr(sys, "path", [str(source_tree.parent), str(tmp_path / "site-packages")])
    reason = backends._extension_missing_reason(str(source_tree), ImportError("no module named _C"))
    assert reason == (f"the CUDA extension kd_kernels._C is not built in {source_tree} (no module named _C); on a "
                      f"machine with nvcc and a CUDA build of torch, from the repository root: {EDITABLE_INSTALL}")


def test_a_build_that_fails_to_load_is_not_called_missing(tmp_path, source_tree):
    (source_tree / f"_C{SUFFIX}").write_bytes(b"")
    reason = backends._extension_missing_reason(str(source_tree), ImportError("undefined symbol: at_foo"))
    assert reason.startswith(f"kd_kernels._C at {source_tree / f'_C{SUFFIX}'} failed to load (undefined symbol: "
                             "at_foo); rebuild it against this torch")


def test_the_triton_reason_without_a_gpu_says_when_to_set_the_interpreter(monkeypatch):
    monkeypatch.setattr(backends.torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    backends._triton_status.cache_clear()
    try:
        ok, reason = backends._triton_status()
    finally:
        backends._triton_status.cache_clear()
    assert not ok and "set TRITON_INTERPRET=1 before Python starts" in reason and "cached" in reason
