"""Temporal's sandbox as the worker runs it (workers.sandbox_code): tgp's workflow packages are
passed through, so a node's run imports none of them again; a workflow module outside them is
still imported for each run, with its own state, and still refused the clock. Checked on a probe
package written for the test, in two runs alive at once, on the real dev server, and on the
runner's instance for tgp's node workflow."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import sys
import textwrap
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pydantic
import pytest
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.api.failure.v1 import Failure
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle
from temporalio.converter import DataConverter, PayloadCodec, SerializationContext, WithSerializationContext
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker, WorkflowRunner
from temporalio.worker._workflow_instance import WorkflowInstanceDetails
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner
from temporalio.worker.workflow_sandbox._runner import _fake_info
from temporalio.workflow import _Definition

import activities
import tgp
import workflows
from tests.conftest import eventually
from workers.main import WORKFLOWS, workflow_runner
from workers.sandbox_code import SandboxRunner, compiled

PACKAGE = "sandboxcodeprobe"

PROBE = textwrap.dedent(
    """
    import datetime
    from temporalio import workflow

    RUNS = []  # module state: each run's own


    def marker() -> int:
        return 1


    @workflow.defn(name="SandboxCodeProbe")
    class Probe:
        def __init__(self) -> None:
            self.done = False

        @workflow.run
        async def run(self, read_clock: bool) -> None:
            if read_clock:
                datetime.datetime.now()  # the sandbox must still refuse this
            RUNS.append(1)
            await workflow.wait_condition(lambda: self.done)

        @workflow.signal
        def finish(self) -> None:
            self.done = True

        @workflow.query
        def ids(self) -> list[int]:
            return [id(marker.__code__), id(marker), len(RUNS)]
    """
)


@pytest.fixture
def probe_module(tmp_path: Path) -> Iterator[type]:
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "wf.py").write_text(PROBE)
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module(f"{PACKAGE}.wf").Probe
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
            del sys.modules[name]


async def two_runs(env: WorkflowEnvironment, probe: type) -> list[list[int]]:
    """Start two runs, read each one's ids while both are alive, then end them."""
    queue = f"sandbox-code-{uuid.uuid4().hex[:8]}"
    async with Worker(env.client, task_queue=queue, workflows=[probe], workflow_runner=workflow_runner({})):
        handles: list[WorkflowHandle] = [
            await env.client.start_workflow("SandboxCodeProbe", False, id=f"{queue}-{n}", task_queue=queue) for n in range(2)
        ]
        ids = [await h.query("ids") for h in handles]
        for h in handles:
            await h.signal("finish")
            await h.result()
    return ids


async def test_a_module_outside_tgps_workflows_is_imported_for_each_run(temporal: WorkflowEnvironment, probe_module: type) -> None:
    (code_a, function_a, runs_a), (code_b, function_b, runs_b) = await two_runs(temporal, probe_module)
    assert function_a != function_b and code_a != code_b, "the runs share a module: the sandbox's isolation is gone"
    assert runs_a == runs_b == 1, "a run saw another run's module state"


async def test_the_sandbox_still_refuses_the_clock_outside_tgps_workflows(temporal: WorkflowEnvironment, probe_module: type) -> None:
    queue = f"sandbox-code-{uuid.uuid4().hex[:8]}"
    async with Worker(temporal.client, task_queue=queue, workflows=[probe_module], workflow_runner=workflow_runner({})):
        handle = await temporal.client.start_workflow("SandboxCodeProbe", True, id=queue, task_queue=queue)

        async def failed_task() -> str | None:
            async for event in handle.fetch_history_events():
                if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
                    return event.workflow_task_failed_event_attributes.failure.message
            return None

        message = await eventually(failed_task, what="the sandbox failing the task that reads the clock")
        await handle.terminate()
    assert "datetime.datetime.now" in message


def _details(cls: type) -> Any:
    """What the worker gives its runner for a new run of workflow class `cls`."""
    return WorkflowInstanceDetails(
        payload_converter_factory=DataConverter.default._new_payload_converter,
        failure_converter_class=DataConverter.default.failure_converter_class,
        interceptor_classes=[],
        defn=_Definition.must_from_class(cls),
        info=_fake_info,
        randomness_seed=1,
        extern_functions={},
        disable_eager_activity_execution=False,
        worker_level_failure_exception_types=[],
        patch_activation_callback=None,
        last_completion_result=Payloads(),
        last_failure=Failure(),
    )


async def test_a_run_of_tgps_workflows_imports_none_of_their_modules_again() -> None:
    """A new run of each of tgp's workflows runs the class the worker imported: nothing of
    workflows/ is executed again for it (~4.4 ms of the worker's CPU a node when it was)."""
    runner = workflow_runner({})
    for cls in WORKFLOWS:
        run = runner.create_instance(_details(cls))
        inside = run.globals_and_locals["__temporal_workflow_class"]  # type: ignore[attr-defined]
        assert inside is cls, f"{cls.__name__}: its module was imported again for the run"


# --- the sandbox's hops: what the SDK's path answers, ours answers ---------------------------------

HOPS_PROBE = textwrap.dedent(
    """
    from datetime import timedelta
    from temporalio import activity, workflow


    @activity.defn(name="hops_echo")
    async def echo(text: str) -> str:
        return text


    @workflow.defn(name="SandboxHopsProbe")
    class HopsProbe:
        @workflow.run
        async def run(self, text: str) -> list[str]:
            remote = await workflow.execute_activity(echo, text, start_to_close_timeout=timedelta(seconds=10))
            local = await workflow.execute_local_activity(echo, text + "!", start_to_close_timeout=timedelta(seconds=10))
            workflow.upsert_memo({"seen": remote})
            return [remote, local]
    """
)


@dataclasses.dataclass
class RecordingCodec(PayloadCodec, WithSerializationContext):
    """Passes payloads through; records each serialization context the SDK configures it with."""

    seen: list[SerializationContext] = dataclasses.field(default_factory=list)

    def with_context(self, context: SerializationContext) -> RecordingCodec:
        self.seen.append(context)
        return self

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return list(payloads)

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return list(payloads)


def _shown(context: SerializationContext, workflow_id: str) -> str:
    """A context with the run's own workflow id taken out (each run has its own)."""
    fields = {k: ("<wf>" if v == workflow_id else v) for k, v in dataclasses.asdict(context).items()}  # type: ignore[call-overload]
    return f"{type(context).__name__}{sorted(fields.items())}"


@pytest.fixture
def hops_probe(tmp_path: Path) -> Iterator[ModuleType]:
    package = tmp_path / f"{PACKAGE}hops"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "wf.py").write_text(HOPS_PROBE)
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module(f"{PACKAGE}hops.wf")
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.startswith(f"{PACKAGE}hops")]:
            del sys.modules[name]


async def contexts_seen(env: WorkflowEnvironment, probe: ModuleType, runner: WorkflowRunner) -> tuple[list[str], list[str]]:
    """Run the probe (an activity, a local activity, a memo) on `runner`; the serialization
    contexts its payloads were encoded and decoded with, and its result."""
    codec = RecordingCodec()
    client = Client(**{**env.client.config(), "data_converter": dataclasses.replace(DataConverter.default, payload_codec=codec)})
    queue = f"sandbox-hops-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=[probe.HopsProbe], activities=[probe.echo], workflow_runner=runner):
        result = await client.execute_workflow("SandboxHopsProbe", "hi", id=queue, task_queue=queue, result_type=list[str])
    return sorted(_shown(c, queue) for c in codec.seen), result


async def test_the_cheaper_hops_give_each_payload_the_sdks_serialization_context(temporal: WorkflowEnvironment, hops_probe: ModuleType) -> None:
    theirs, their_result = await contexts_seen(temporal, hops_probe, SandboxedWorkflowRunner())
    ours, our_result = await contexts_seen(temporal, hops_probe, workflow_runner({}))
    assert isinstance(workflow_runner({}), SandboxRunner)
    assert our_result == their_result == ["hi", "hi!"]
    assert any(c.startswith("ActivitySerializationContext") for c in theirs), "the probe did not reach an activity's context"
    assert ours == theirs


def test_each_source_the_sandbox_runs_is_compiled_once() -> None:
    source = "__temporal_probe = 1\n"
    assert compiled(source) is compiled(source)
    namespace: dict[str, object] = {}
    exec(compiled(source), namespace)
    assert namespace["__temporal_probe"] == 1


async def test_both_context_hops_answer_as_the_sdks_for_a_run(hops_probe: ModuleType) -> None:
    """The external-store context too (no codec sees it unless external storage is set): one
    run's instance on each runner, asked for a payload of no command and of an activity."""
    from temporalio.api.enums.v1 import CommandType
    from temporalio.worker._command_aware_visitor import CommandInfo

    details = _details(hops_probe.HopsProbe)
    theirs, ours = SandboxedWorkflowRunner().create_instance(details), SandboxRunner().create_instance(details)
    for info in (None, CommandInfo(CommandType.COMMAND_TYPE_SCHEDULE_ACTIVITY_TASK, 1)):
        assert ours.get_serialization_context(info) == theirs.get_serialization_context(info)
        assert ours.get_external_store_context(info) == theirs.get_external_store_context(info)


async def test_a_workflow_the_sandbox_refuses_is_refused_by_every_worker(temporal: WorkflowEnvironment, tmp_path: Path) -> None:
    """Validation is once per process for a definition that passed (workers.sandbox_code
    `SandboxRunner.prepare_workflow`); one that failed is validated, and refused, again."""
    package = tmp_path / "sandboxrefusedprobe"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "wf.py").write_text(textwrap.dedent(
        """
        import datetime
        from temporalio import workflow

        STARTED = datetime.datetime.now()  # the sandbox refuses the clock at import


        @workflow.defn(name="SandboxRefusedProbe")
        class Refused:
            @workflow.run
            async def run(self) -> None:
                pass
        """
    ))
    sys.path.insert(0, str(tmp_path))
    try:
        refused = importlib.import_module("sandboxrefusedprobe.wf").Refused
        for _ in range(2):
            with pytest.raises(Exception, match="Failed validating workflow SandboxRefusedProbe"):
                Worker(temporal.client, task_queue="never", workflows=[refused], workflow_runner=workflow_runner({}))
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.startswith("sandboxrefusedprobe")]:
            del sys.modules[name]


def test_every_model_a_workflow_builds_is_complete_at_import() -> None:
    """A pydantic model whose fields name a model defined further down is completed at its first
    use unless completed at import; at a first use inside a run's sandbox it cannot see its
    module, and the run's task fails (`JoinPlan` is not fully defined)."""
    for package in (tgp, workflows, activities):
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            importlib.import_module(info.name)
    seen: set[type] = set()
    todo = [pydantic.BaseModel]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
    ours = ("tgp.", "workflows.", "activities.")
    incomplete = [f"{m.__module__}.{m.__qualname__}" for m in seen if m.__module__.startswith(ours) and not m.__pydantic_complete__]
    assert not incomplete, incomplete
