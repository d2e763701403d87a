"""The KV cache's tensors: per layer, a pool of blocks on the device and a pool of host blocks for swapping.
Which block belongs to whom is `engine.block_manager`'s business; this file only stores and copies."""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, num_host_blocks: int = 0) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # Zeroed, not empty: padded attention reads unused slots, and garbage there could be NaN/inf.
        self.key = torch.zeros(shape, dtype=dtype, device=device)
        self.value = torch.zeros(shape, dtype=dtype, device=device)
        host_shape = (num_layers, num_host_blocks, block_size, num_kv_heads, head_dim)
        self.host_key = torch.zeros(host_shape, dtype=dtype, device="cpu")
        self.host_value = torch.zeros(host_shape, dtype=dtype, device="cpu")

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the new tokens' keys and values ([tokens, kv_heads, head_dim]) at flat slot indices."""
        flat = self.num_blocks * self.block_size
        self.key[layer].view(flat, *key.shape[1:]).index_copy_(0, slot_mapping, key)
        self.value[layer].view(flat, *value.shape[1:]).index_copy_(0, slot_mapping, value)

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        if mapping:
            device_ids, host_ids = _split(mapping, self.key.device)
            self.host_key[:, host_ids.cpu()] = self.key[:, device_ids].cpu()
            self.host_value[:, host_ids.cpu()] = self.value[:, device_ids].cpu()

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        if mapping:
            host_ids, device_ids = _split(mapping, self.key.device)
            self.key[:, device_ids] = self.host_key[:, host_ids.cpu()].to(self.key.device)
            self.value[:, device_ids] = self.host_value[:, host_ids.cpu()].to(self.value.device)


def _split(mapping: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = torch.tensor(mapping, dtype=torch.long, device=device)
    return pairs[:, 0], pairs[:, 1]
