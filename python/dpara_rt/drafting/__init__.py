"""Drafting: the one interface a round drafts through (``backend.DraftingBackend``) and the device backend
(``device.DeviceBackend``: torch and Triton on any device). The CPU host's backend is ``dpara_rt.host.backend``."""
from dpara_rt.drafting.backend import DraftingBackend
from dpara_rt.drafting.device import DeviceBackend, LocalContext

__all__ = ["DeviceBackend", "DraftingBackend", "LocalContext"]
