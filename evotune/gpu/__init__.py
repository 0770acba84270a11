"""Work on the GPU: verify and time a compiled candidate, worker processes, sanitizer runs, launch packets."""
