"""autograd.Functions over the Triton kernels (imported lazily by `kd_kernels.api`)."""
