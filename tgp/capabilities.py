"""What each provider can and cannot do, checked when a GPUNodeClass is validated so a class
that asks for the impossible gets a clear condition instead of a silent failure."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

BootPayloadKind = Literal["cloud-init", "startup-script", "onstart", "env"]
MachineKind = Literal["vm", "container", "container-or-vm"]


class ProviderCapabilities(BaseModel):
    model_config = ConfigDict(frozen=True)
    machine: MachineKind = Field(description="What a launch gives you.")
    boot_payload: BootPayloadKind = Field(description="How first-boot configuration is delivered.")
    joins_as_node: bool = Field(description="Can the machine run a kubelet and become a Kubernetes Node?")
    spot: bool = Field(description="Can tgp buy interruptible (spot/bid) capacity through the API?")
    talos: bool = Field(False, description="Can it boot Talos directly through the API?")
    why_not_node: str = ""


def capability_problems(provider: str, caps: ProviderCapabilities, *, wants_talos: bool, wants_spot: bool) -> list[str]:
    """Messages naming what `provider` cannot do for this class; empty when it fits."""
    problems = []
    if not caps.joins_as_node:
        problems.append(f"provider {provider} cannot become a Kubernetes node: {caps.why_not_node}")
    if wants_talos and not caps.talos:
        problems.append(
            f"provider {provider} cannot boot Talos through its API ({caps.machine}, boot payload {caps.boot_payload}); "
            "use a cloud-init/startup-script template that joins as a kubelet"
        )
    if wants_spot and not caps.spot:
        problems.append(f"provider {provider} offers no spot capacity through its API")
    return problems
