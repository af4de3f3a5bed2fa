"""Replay buffers: CRPS's success buffer of task instances, SPEAR's self-imitation and baseline buffers."""
from agentrl.buffers.sil import BaselineBuffer, SILBuffer, SILEntry, dual_filter
from agentrl.buffers.success import SuccessBuffer, SuccessEntry

__all__ = ["SuccessBuffer", "SuccessEntry", "SILBuffer", "SILEntry", "BaselineBuffer", "dual_filter"]
