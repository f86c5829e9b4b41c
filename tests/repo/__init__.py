"""The repository as shipped: the wheel and its installed package, Dockerfile / proto / Kubernetes lint."""
