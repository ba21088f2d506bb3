"""A GPU node's life, one module per stage (Karpenter's nodeclaim/lifecycle, as a workflow):
`workflow.py` is the spine that reads top to bottom; `launch`, `join`, `labels`, `watch`,
`drain` and `release` are the stages; `life` is what they share."""

from workflows.node.workflow import GPUNodeWorkflow

__all__ = ["GPUNodeWorkflow"]
