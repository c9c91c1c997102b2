"""One rank: device, model weights, KV cache and the model runner."""

from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig
from engine.model_runner import ModelRunner, StepInput, StepOutput
from models.loader import load_model
from models.parallel import ParallelMapping

logger = logging.getLogger(__name__)


def num_kv_blocks(config: EngineConfig, bytes_per_block: int) -> int:
    """Blocks that fit the memory budget, capped at what the scheduler could ever use."""
    cc, sc = config.cache_config, config.scheduler_config
    if cc.num_blocks_override is not None:
        return cc.num_blocks_override
    if config.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(config.device)
        budget = int(free * cc.gpu_memory_utilization)
    else:
        budget = cc.kv_cache_memory_bytes
    cap = sc.max_num_seqs * -(-sc.max_model_len // cc.block_size) + 1
    blocks = min(budget // bytes_per_block, cap)
    if blocks < -(-sc.max_model_len // cc.block_size):
        raise ValueError(
            f"the KV cache budget holds {blocks} blocks of {cc.block_size} tokens, fewer than one "
            f"request of max_model_len={sc.max_model_len} needs; raise the budget or lower "
            "max_model_len"
        )
    return blocks


class Worker:
    def __init__(self, config: EngineConfig, mapping: ParallelMapping | None = None) -> None:
        self.config = config
        self.mapping = mapping or ParallelMapping()
        mc = config.model_config
        self.model = load_model(mc.model, mc.dtype, config.device, self.mapping, mc.hf_config)
        self.runner = ModelRunner(
            self.model, config.device, config.cache_config.block_size, mc.seed
        )
        self.bytes_per_block = self.runner.kv_bytes_per_block(mc.dtype)
        self.num_blocks = num_kv_blocks(config, self.bytes_per_block)
        self.runner.allocate_kv_cache(self.num_blocks, mc.dtype)
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB)",
            self.num_blocks,
            config.cache_config.block_size,
            self.num_blocks * self.bytes_per_block / 2**20,
        )

    def execute(self, step: StepInput) -> StepOutput:
        return self.runner.execute(step)
