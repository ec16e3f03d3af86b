"""End-to-end tests of remote workers: real control plane and worker processes on loopback."""
