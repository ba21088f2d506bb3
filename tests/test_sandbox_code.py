"""The sandbox's runs share the workflow modules' bytecode, and nothing else (workers.sandbox_code).

Temporal's sandbox imports a workflow's module again for each run; with the shared loader the
runs' functions are their own but their code objects one, the module's state stays each run's,
and the sandbox's restrictions still fail a run that reads the clock. Checked on a probe package
written for the test, in two runs alive at once (so that ids cannot be reused), on the real dev
server."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import sys
import textwrap
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

import pytest
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle
from temporalio.converter import DataConverter, PayloadCodec, SerializationContext, WithSerializationContext
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker, WorkflowRunner
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner

from tests.conftest import eventually
from workers.main import workflow_runner
from workers.sandbox_code import SandboxRunner, SharedCodeFinder, SharedCodeLoader, compiled, share_workflow_code

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


@pytest.fixture
def shared_code() -> Iterator[SharedCodeFinder]:
    finder = SharedCodeFinder([PACKAGE])
    sys.meta_path.insert(0, finder)
    try:
        yield finder
    finally:
        sys.meta_path.remove(finder)


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


async def test_runs_share_code_objects_but_not_functions_or_module_state(temporal: WorkflowEnvironment, probe_module: type, shared_code: SharedCodeFinder) -> None:
    (code_a, function_a, runs_a), (code_b, function_b, runs_b) = await two_runs(temporal, probe_module)
    assert code_a == code_b, "each run unmarshalled the module's code again"
    assert function_a != function_b, "the runs share a module: the sandbox's isolation is gone"
    assert runs_a == runs_b == 1, "a run saw another run's module state"


async def test_without_the_shared_loader_each_run_has_its_own_code(temporal: WorkflowEnvironment, probe_module: type) -> None:
    # The control: what the test above tells apart (the sandbox reads the module for each run).
    (code_a, _, _), (code_b, _, _) = await two_runs(temporal, probe_module)
    assert code_a != code_b


async def test_the_sandbox_still_refuses_the_clock_in_shared_code(temporal: WorkflowEnvironment, probe_module: type, shared_code: SharedCodeFinder) -> None:
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
    assert any(path.endswith(f"{PACKAGE}/wf.py") for path, _, _ in SharedCodeLoader.codes), "the run did not load through the shared loader"


def test_a_finder_for_other_packages_does_not_stand_in_for_tgps(shared_code: SharedCodeFinder) -> None:
    finder = share_workflow_code()
    assert finder is not shared_code and "workflows" in finder.packages
    assert share_workflow_code() is finder  # installed once


def test_the_worker_loads_tgps_workflow_modules_with_the_shared_loader() -> None:
    installed = [f for f in sys.meta_path if isinstance(f, SharedCodeFinder)]
    for f in installed:  # conftest installs one for every test: start without
        sys.meta_path.remove(f)
    try:
        workflow_runner({})  # the default runner: the sandbox, with its runs sharing code
        finder = next((f for f in sys.meta_path if isinstance(f, SharedCodeFinder)), None)
        assert finder is not None, "the worker's runner did not install the shared loader"
        path_finder = importlib.machinery.PathFinder
        assert sys.meta_path.index(finder) < sys.meta_path.index(path_finder)  # or it is never asked
        import workflows

        spec = finder.find_spec("workflows.node", workflows.__path__)
        assert spec is not None and isinstance(spec.loader, SharedCodeLoader)
        assert finder.find_spec("tgp.lifecycle", None) is None  # passed through: never imported again
        sys.meta_path.remove(finder)
    finally:
        for f in reversed(installed):
            sys.meta_path.insert(0, f)


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
    from temporalio.api.common.v1 import Payloads
    from temporalio.api.enums.v1 import CommandType
    from temporalio.api.failure.v1 import Failure
    from temporalio.worker._command_aware_visitor import CommandInfo
    from temporalio.worker._workflow_instance import WorkflowInstanceDetails
    from temporalio.worker.workflow_sandbox._runner import _fake_info
    from temporalio.workflow import _Definition

    details = WorkflowInstanceDetails(
        payload_converter_factory=DataConverter.default._new_payload_converter,
        failure_converter_class=DataConverter.default.failure_converter_class,
        interceptor_classes=[],
        defn=_Definition.must_from_class(hops_probe.HopsProbe),
        info=_fake_info,
        randomness_seed=1,
        extern_functions={},
        disable_eager_activity_execution=False,
        worker_level_failure_exception_types=[],
        patch_activation_callback=None,
        last_completion_result=Payloads(),
        last_failure=Failure(),
    )
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
