"""The NIXL data plane: the only package that imports nixl."""
