"""Host side of the engine: requests, resource managers and the scheduler (pure Python + numpy, no JAX).

One concept per file: ``sampling_params`` (what a request asks for), ``sequence`` (one request's host state),
``outputs`` (what generate returns), ``block_manager`` (paged KV blocks), ``state_manager`` (per-sequence state
slots), ``scheduler`` (turns queues into one plain ``SchedulerOutput`` per step and applies its results).
"""

from dijax.runtime.block_manager import BlockManager
from dijax.runtime.outputs import RequestOutput
from dijax.runtime.sampling_params import SamplingParams
from dijax.runtime.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from dijax.runtime.sequence import Sequence, SequenceStatus
from dijax.runtime.state_manager import StateManager

__all__ = ["BlockManager", "RequestOutput", "SamplingParams", "ScheduledChunk", "Scheduler", "SchedulerOutput",
           "Sequence", "SequenceStatus", "StateManager"]
