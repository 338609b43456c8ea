"""TENSILE: tensor-granularity swap/recompute memory scheduling for one training job.

Trace one training step → access timeline → greedy peak-shaving plan → runtime that
applies the plan every step. The planner and simulator are pure Python (CPU-tested);
the runtime needs CUDA, with a CPU simulation mode for its bookkeeping. Several jobs on
one GPU: ``python -m tensile.server`` plans them jointly; jobs connect with
:class:`TensileClient` (:mod:`tensile.multi` holds the joint planner). A host-bound job
can run its planned step as one CUDA graph: ``Scheduler.capture`` (:mod:`tensile.graph`).
``stream_optimizer`` moves the optimizer's update into backward and its state to the host
(:mod:`tensile.streamed`); ``tune_resident`` chooses how much of it stays on the device
(:mod:`tensile.resident`), ``tune_pace`` when its row slices go (:mod:`tensile.pace`);
``defer_weight_grads`` makes large linear layers' weight gradients
at the end of backward, off the peak at its start (:mod:`tensile.defer`). A job too large to
run one step unplanned is recorded at small batches and scaled (:mod:`tensile.scale`,
``Scheduler(..., record_batches=...)``).
``trim_stack`` gives back the thread-stack memory a CUDA context reserves and never uses
(:mod:`tensile.stack`); ``compact`` allocates a job's long-lived tensors again side by side
so that the holes its first step left go back (:mod:`tensile.compact`);
``trim_blas_workspace`` gives back the cuBLAS workspaces and makes later ones small
(:mod:`tensile.workspace`). Graphs captured before any of these must be captured again
(``GraphStep`` refuses them, ``Scheduler.replay`` re-captures).
"""
from .api import Scheduler, SchedulerReport
from .estimate import OpTimeModel, estimate_op_times, measure_copy_bandwidth, measure_peak_rates
from .graph import GraphStep
from .plan import Plan, Recompute, Swap
from .planner import plan
from .record import Recording, record_step
from .scale import ScaleError, scale_recording
from .runtime import PlanMismatchError, PlanRunner, RuntimeStats
from .simulate import SimResult, simulate
from .snapshot import PlanningSnapshot
from .compact import CompactResult, compact, compact_count
from .stack import StackReservation, stack_reservation, trim_count, trim_stack
from .workspace import blas_trim_count, trim_blas_workspace
from .step import training_step
from .streamed import StreamedOptimizer, stream_optimizer
from .defer import DeferredWeightGrads, defer_weight_grads
from .resident import tune_resident
from .pace import tune_pace
from .baselines import METHODS, StepFn, checkpoint_blocks, make_method
from .client import SchedulerError, TensileClient
from .policies import capuchin_plan, vdnn_plan
from .multi import JobSpec, JointPlan, plan_jobs, simulate_joint
from .timeline import AccessTimeline, TensorInfo

__all__ = [
    "Scheduler", "SchedulerReport", "GraphStep", "AccessTimeline", "TensorInfo", "Plan", "Swap",
    "Recompute", "plan", "PlanningSnapshot", "simulate", "SimResult", "estimate_op_times", "OpTimeModel",
    "measure_peak_rates", "measure_copy_bandwidth", "Recording", "record_step",
    "ScaleError", "scale_recording",
    "PlanRunner", "PlanMismatchError", "RuntimeStats", "training_step",
    "StreamedOptimizer", "stream_optimizer", "tune_resident", "tune_pace", "DeferredWeightGrads",
    "defer_weight_grads",
    "TensileClient", "SchedulerError", "JobSpec", "JointPlan", "plan_jobs", "simulate_joint",
    "METHODS", "StepFn", "make_method", "checkpoint_blocks", "vdnn_plan", "capuchin_plan",
    "StackReservation", "stack_reservation", "trim_count", "trim_stack",
    "CompactResult", "compact", "compact_count", "blas_trim_count", "trim_blas_workspace",
]
