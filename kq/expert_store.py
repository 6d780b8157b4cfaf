"""``kq.expert_store``: the safetensors expert reader, re-exported from :mod:`kq_host.expert_store`."""

from kq_host.expert_store import ExpertStore, ExpertStoreError, read_safetensors_header

__all__ = ["ExpertStore", "ExpertStoreError", "read_safetensors_header"]
