"""Shared test setup: markers, the Triton interpreter on CPU, and float64 helpers.

TRITON_INTERPRET=1 must be in the environment before any Triton kernel is defined, so it
is set here, at collection time, whenever no CUDA device is present.
"""
import os

# pytest-xdist workers (-n N): the cores shared out among them (with -n 2 on CI's 2 cores, one
# thread each instead of four threads spinning on two cores); set before torch and numpy load
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist workers (-n): each its own Ray temp directory, so a local ray.init() of one never
# joins the cluster another one started (Ray records the current cluster there)
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("RAY_TMPDIR", f"/tmp/ray_{os.environ['PYTEST_XDIST_WORKER']}")

HAS_CUDA = torch.cuda.is_available()


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


HAS_TRITON = _triton_importable()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "interpret: runs Triton kernels, on CPU under TRITON_INTERPRET=1")
    config.addinivalue_line("markers", "cuda_ext: needs the compiled CUDA extension")
    config.addinivalue_line("markers", "slow: long-running")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="no CUDA device")
    skip_triton = pytest.mark.skip(reason="triton is not installed")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "interpret" in item.keywords and not HAS_TRITON:
            item.add_marker(skip_triton)


@pytest.fixture
def ray_cluster():
    """A local Ray of 2 CPUs for the driver's runs, started by the first test of this process
    that asks for it and kept for the next ones, whatever their module (each start costs
    seconds). A fixture that needs another cluster shuts it down first; the next test that asks
    for this one starts it again."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
