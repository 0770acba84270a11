"""From a Config to a cubin: template instantiation, NVRTC compile and resources, SASS, export, TMA maps."""
