"""The node agent: runs captures and restores on its node (CRIU + native helper). Never imports ``controller``."""
