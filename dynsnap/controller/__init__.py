"""The dynsnap controller: DGDs, pods, DWMs and EndpointSlices to decisions. Never imports ``agent``."""
