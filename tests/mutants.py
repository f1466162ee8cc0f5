"""Breaks the library one way at a time and checks that the suite notices.

A test proves only what it would catch. Each mutant below is one way recompute
could go wrong for a user (a dropout mask drawn again, a gradient counted
twice, a weight read after the optimizer wrote it, a recompute that never
runs, a plan over its budget) written as one replacement in the library's
source. For each, a copy of this checkout is made, the replacement applied,
and the tests named beside it run with that Keras backend (`pytest -x`): the
mutant is *killed* when a test fails, and *survives* when they all pass, which
means the suite would not notice that defect. A mutant whose text is no longer
in its file, or whose tests the suite runs only in another backend's run, is
reported as *stale* (update the mutant, do not drop it); `tests/test_docs.py`
checks that none is.

```
python tests/mutants.py                          # every mutant whose backend is installed
python tests/mutants.py --only torch_rng_not_restored jax_backward_doubled
python tests/mutants.py --out benchmarks/results/mutants.json
python tests/mutants.py --quick                  # CI's selection (QUICK): about 3 minutes
```

Each mutant runs in a copy of its own (in a temporary folder), so the checkout
is never edited, and on 2 cores two run at a time (`--jobs`). A kill counts where the same
tests pass without the mutant: the suite passes at the commit (CI), and
`--control` runs each selection on an unmutated copy too, in the same run.
"""

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What each backend's run sets besides KERAS_BACKEND (as `tests/run_backends.py`'s runs).
ENVIRONMENTS = {
    "tensorflow": {},
    "jax": {"KERAS_RECOMPUTE_TESTS_WITHOUT_TENSORFLOW": "1"},
    "torch": {},
}
# The seed's environments (standalone Keras 2.3 on TensorFlow 1.15, and TensorFlow 2.0 with its tf.keras: Python 3.7
# virtual environments built by `tests/legacy/run.py`), where a mutant's tests are named from the checkout's root, as
# that runner runs them.
LEGACY = ("tf1.15-keras2.3", "tf2.0-keras2.3")


class Mutant:
    """One defect: `old` replaced by `new` in `path`, to be caught by `tests` on `backend`."""

    def __init__(self, name, what, path, old, new, backend, tests):
        self.name, self.what, self.path, self.old, self.new = name, what, path, old, new
        self.backend, self.tests = backend, list(tests)

    def problem(self, root=ROOT):
        """Why the mutant cannot be applied to the source under `root`, or its tests not run as the suite runs
        them (None if it can)."""
        with open(os.path.join(root, self.path)) as f:
            count = f.read().count(self.old)
        if count != 1:
            return f"{self.path} has its text {count} times, not once: update the mutant"
        elsewhere = [t for t in self.tests if t.split("::")[0] in _tensorflow_run_only()]
        if self.backend in ("jax", "torch") and elsewhere:
            # Named on the command line, pytest would run them anyway, as the suite never does.
            return (f"{', '.join(elsewhere)} run only in the suite's TensorFlow run (tests/conftest.py): give the "
                    "mutant backend 'tensorflow'")
        return None

    def apply(self, root):
        path = os.path.join(root, self.path)
        with open(path) as f:
            source = f.read()
        with open(path, "w") as f:
            f.write(source.replace(self.old, self.new))


MUTANTS = [
    # The decorator and recompute_model.
    Mutant(
        "decorator_never_recomputes", "a decorated call runs plain when recompute is on (gradients stay exact)",
        "keras_recompute/_decorator.py", "if not on or _saving_a_model():", "if True:",
        "jax", ["test_keras3.py"],
    ),
    Mutant(
        "recompute_model_decorates_off", "recompute_model decorates its units switched off",
        "keras_recompute/_model.py",
        "wrapped = recompute_grad(layer.call, enabled=enabled, policy=policy, offload=offload)",
        "wrapped = recompute_grad(layer.call, enabled=False, policy=policy, offload=offload)",
        "torch", ["test_model.py"],
    ),
    Mutant(
        "decorating_twice_recomputes_twice", "a call decorated twice (an instance patched over a decorated class) "
        "recomputes inside its own recompute",
        "keras_recompute/_decorator.py", "    fn = _undecorated(fn)\n", "\n",
        "torch", ["test_context.py"],
    ),
    Mutant(
        "environment_variable_ignored", "RECOMPUTE=1 does not switch recompute on (only a scope does)",
        "keras_recompute/_config.py", "    return parse_bool(os.environ.get(ENV_VAR))", "    return False",
        "tensorflow", ["test_config.py"],
    ),
    Mutant(
        "saving_runs_the_recompute", "a model saved with recompute on saves the recompute's machinery (NOTE [ saving "
        "a model ])",
        "keras_recompute/_decorator.py", "if not on or _saving_a_model():", "if not on:",
        "tensorflow", ["test_tensorflow.py::test_a_model_saved_with_recompute_on_saves_the_plain_calls"],
    ),
    # JAX.
    Mutant(
        "jax_full_saves_everything", 'policy="full" keeps every activation (recomputes nothing)',
        "keras_recompute/backends/jax.py",
        "saved = policies.dots_with_no_batch_dims_saveable if policy == _policy.SAVE_DOTS else None",
        "saved = policies.dots_with_no_batch_dims_saveable if policy == _policy.SAVE_DOTS else "
        "policies.everything_saveable",
        "jax", ["test_policy.py"],
    ),
    Mutant(
        "jax_save_dots_saves_nothing", 'policy="save_dots" keeps no matmul output (acts as "full")',
        "keras_recompute/backends/jax.py",
        "saved = policies.dots_with_no_batch_dims_saveable if policy == _policy.SAVE_DOTS else None",
        "saved = policies.nothing_saveable if policy == _policy.SAVE_DOTS else None",
        "jax", ["test_policy.py"],
    ),
    Mutant(
        "jax_backward_doubled", "the recompute's backward returns twice the gradient",
        "keras_recompute/backends/jax.py", "            return vjp(cotangents)",
        "            return vjp(jax.tree_util.tree_map(lambda c: 2 * c, cotangents))",
        "jax", ["test_keras3.py"],
    ),
    Mutant(
        "jax_recompute_does_not_wait", "the recompute no longer waits for the incoming gradient (XLA may hoist it)",
        "keras_recompute/backends/jax.py",
        "    if zero is None:\n        return tree", "    if True:\n        return tree",
        "jax", ["test_policy.py"],
    ),
    Mutant(
        "jax_state_updates_dropped", "a recomputed call's state updates (BatchNorm's statistics) are lost",
        "keras_recompute/backends/jax.py",
        'for variable, value in zip(traced["variables"], updates):\n        variable.assign(value)',
        'for variable, value in zip(traced["variables"], updates):\n        pass',
        "jax", ["test_keras3.py"],
    ),
    # PyTorch.
    Mutant(
        "torch_rng_not_restored", "the recompute draws dropout masks again from where the generator stands",
        "keras_recompute/backends/torch.py", "preserve_rng_state=True,", "preserve_rng_state=False,",
        "torch", ["test_keras3.py"],
    ),
    Mutant(
        "torch_keras_state_not_replayed", "Keras's seed generators and state are not put back for the recompute",
        "keras_recompute/backends/torch.py", "_keras3.replay(state, owner))", "contextlib.nullcontext())",
        "torch", ["test_keras3.py"],
    ),
    Mutant(
        "torch_inputs_not_copied", "a call that writes its inputs in place (keras-hub's Gemma) recomputes from the "
        "written values",
        "keras_recompute/backends/torch.py",
        "call_args, call_kwargs = keras.tree.map_structure(_copy, (call_args, call_kwargs))", "pass",
        "torch", ["test_inplace_torch.py", "test_policy.py::test_keras_hub_lora_backbones_under_each_policy"],
    ),
    Mutant(
        "torch_never_checkpoints", "the call runs plain on PyTorch (gradients stay exact, nothing is saved)",
        "keras_recompute/backends/torch.py", "if not torch.is_grad_enabled() or _keras3.in_symbolic_scope():",
        "if True:",
        "torch", ["test_keras3.py"],
    ),
    Mutant(
        "torch_replay_leaves_seed_generator", "replaying a kept mask does not advance its seed generator (the next "
        "step draws other masks than plain's)",
        "keras_recompute/backends/torch.py",
        "torch_random.torch_seed_generator(seed)  # the seed generator advances as in the forward", "pass",
        "torch", ["test_policy.py::test_a_replayed_mask_advances_its_seed_generator_as_the_forward_did"],
    ),
    # TensorFlow.
    Mutant(
        "tf_kept_matmul_reads_weights_again", 'under "save_dots" the kept matmul\'s gradient reads the weights again '
        "(after the optimizer wrote them, in a tf.function)",
        "keras_recompute/backends/tensorflow.py",
        "with contextlib.nullcontext() if tf.executing_eagerly() else variable_reads(reader):",
        "with contextlib.nullcontext():",
        "tensorflow", ["test_tensorflow.py::test_a_compiled_steps_backward_reads_no_trained_weight"],
    ),
    Mutant(
        "tf_recompute_reads_weights_again", "the recompute reads the weights again instead of what its forward read",
        "keras_recompute/backends/tensorflow.py",
        "with keras_replay, (legacy_replay or contextlib.nullcontext()), reads.replaying():",
        "with keras_replay, (legacy_replay or contextlib.nullcontext()):",
        "tensorflow", ["test_tensorflow.py::test_a_compiled_steps_backward_reads_no_trained_weight"],
    ),
    Mutant(
        "tf_recompute_does_not_wait", "the recompute's inputs do not wait for the incoming gradient (the runtime may "
        "recompute during the forward)",
        "keras_recompute/backends/tensorflow.py", "replay_inputs = [wait(x) for x in inputs]",
        "replay_inputs = [tf.identity(x) for x in inputs]",
        "tensorflow", ["test_memory.py", "test_tensorflow.py"],
    ),
    Mutant(
        "tf_gradient_doubled", "the recompute's backward counts the incoming gradient twice",
        "keras_recompute/backends/tensorflow.py", "output_gradients=_add_checks([g for _, g in pairs], checks)",
        "output_gradients=_add_checks([2 * g for _, g in pairs], checks)",
        "tensorflow", ["test_keras3.py"],
    ),
    Mutant(
        "tf_check_compares_nothing", "a recompute that computes another function is not caught (check=True)",
        "keras_recompute/backends/tensorflow.py", "expected = _Expected(out_leaves, heads, keep_values=check)",
        "expected = _Expected(out_leaves, heads, keep_values=False)",
        "tensorflow", ["test_semantics.py"],
    ),
    # What a call sees besides its arguments (masks, Keras state), and its check, on each path.
    Mutant(
        "jax_masks_not_attached", "the recompute's inputs lose the masks Keras attached to them (mask_zero=True)",
        "keras_recompute/backends/jax.py",
        "with _keras3.collect() as scope, context.masks_attached(call_args, call_kwargs):",
        "with _keras3.collect() as scope:",
        "jax", ["test_context.py"],
    ),
    Mutant(
        "torch_masks_not_attached", "the recompute's inputs lose the masks Keras attached to them (mask_zero=True)",
        "keras_recompute/backends/torch.py", "with context.masks_attached(call_args, call_kwargs):",
        "with contextlib.nullcontext():",
        "torch", ["test_context.py"],
    ),
    Mutant(
        "tf_masks_not_attached", "the recompute's inputs lose the masks Keras attached to them (mask_zero=True)",
        "keras_recompute/backends/tensorflow.py",
        "with context.masks_attached(call_args, call_kwargs, transform=wait):",
        "with contextlib.nullcontext():",
        "tensorflow", ["test_context.py"],
    ),
    Mutant(
        "tf_keras_state_not_replayed", "tf_keras's state (BatchNorm's statistics, seeds) is not replayed",
        "keras_recompute/backends/tensorflow.py",
        "legacy_state = None if _keras3.is_layer(owner) else _tf_keras.capture(owner, name)", "legacy_state = None",
        "tensorflow", ["test_semantics.py"],
    ),
    Mutant(
        "torch_check_compares_nothing", "a recompute that computes another function is not caught (check=True)",
        "keras_recompute/backends/torch.py", "values = _RecomputedValues(context.name) if check else None",
        "values = None",
        "torch", ["test_semantics_keras3.py"],
    ),
    Mutant(
        "tf_check_allows_any_difference", "the check's comparison of fingerprints allows any difference (a "
        "recompute that computes another function passes), in eager mode and in a tf.function",
        "keras_recompute/backends/tensorflow.py", 'limit = tolerance * tf.where(finite[0], before[0], 0.0) + 1e-6',
        'limit = tolerance * tf.where(finite[0], before[0], 0.0) + float("inf")',
        "tensorflow", ["test_semantics.py::test_a_raw_random_op_raises_instead_of_a_wrong_gradient",
                       "test_semantics.py::test_a_recompute_no_gradient_reads_is_not_run_in_a_function"],
    ),
    Mutant(
        "tf_recompute_not_ordered_after_weight_gradients", "in a tf.function the unit before waits on no weight "
        "gradient of this one (a constant for its first element), and one inter-op thread holds every unit's recompute",
        "keras_recompute/backends/tensorflow.py", "    return traced(value)\n\n\n_TRACED_FIRST_ELEMENT",
        "    return tf.constant(0.0)\n\n\n_TRACED_FIRST_ELEMENT",
        "tensorflow", ["test_fit.py::test_one_inter_op_thread_frees_each_units_recompute"],
    ),
    Mutant(
        "tf_save_dots_check_off", 'under "save_dots" a recompute that feeds a kept matmul other inputs is not caught',
        "keras_recompute/backends/tensorflow.py",
        "            if self._check:\n                self._seen.append(", "            if False:\n                self._seen.append(",
        "tensorflow", ["test_semantics.py"],
    ),
    Mutant(
        "attention_core_recomputes_nothing", 'policy="attention_core" recomputes no core (the call runs plain)',
        "keras_recompute/_decorator.py", "with _policy.cores_recomputed(layers, recompute_grad, check, offload):",
        "with _policy.cores_recomputed([], recompute_grad, check, offload):",
        "jax", ["test_policy.py::test_what_each_policy_recomputes_in_the_jax_program"],
    ),
    # The integrations.
    Mutant(
        "keras_hub_enable_patches_nothing", "keras_recompute.integrations.keras_hub.enable() decorates no layer",
        "keras_recompute/integrations/keras_hub.py", "            cls.call = decorated", "            pass",
        "jax", ["test_layers.py"],
    ),
    Mutant(
        "bert4keras_enable_patches_nothing", "keras_recompute.integrations.bert4keras.enable() decorates no layer",
        "keras_recompute/integrations/bert4keras.py", "decorated = recompute_grad(_undecorated(call))",
        "decorated = _undecorated(call)",
        "tensorflow", ["test_bert4keras.py"],
    ),
    Mutant(
        "bert4keras_wraps_theirs", "enable() wraps bert4keras's own recompute (RECOMPUTE=1 at its import) instead "
        "of the plain call: theirs doubles the gradient of q = k = v",
        "keras_recompute/integrations/bert4keras.py", "decorated = recompute_grad(_undecorated(call))",
        "decorated = recompute_grad(call)",
        "tensorflow", ["test_bert4keras.py"],
    ),
    # Offload.
    Mutant(
        "jax_offload_stays_on_device", "offload=True keeps the residuals in device memory",
        "keras_recompute/backends/jax.py", "*_placed(list(args[num_consts:]), _HOST))", "*list(args[num_consts:]))",
        "jax", ["test_offload.py"],
    ),
    Mutant(
        "torch_offload_stays_on_device", "offload=True keeps the saved inputs in device memory",
        "keras_recompute/backends/torch.py",
        "offloading = _offloaded(context.name) if offload else contextlib.nullcontext()",
        "offloading = contextlib.nullcontext()",
        "torch", ["test_offload.py"],
    ),
    # TF1-style graphs (`backends/tensorflow_v1.py`): standalone Keras 2.3 on TensorFlow 1.15.
    Mutant(
        "tf1_recompute_reads_weights_again", "in a TF1 graph the recompute reads the weights again (no edge orders "
        "it before the optimizer's write)",
        "keras_recompute/backends/tensorflow_v1.py",
        "with state.replay(wait) if state else contextlib.nullcontext(), reads.replaying():",
        "with state.replay(wait) if state else contextlib.nullcontext():",
        "tf1.15-keras2.3", ["tests/legacy/test_keras2.py::test_the_recompute_reads_no_trained_weight_again"],
    ),
    Mutant(
        "tf1_keras2_state_not_replayed", "standalone Keras's random draws and state are not replayed: dropout masks "
        "drawn again",
        "keras_recompute/backends/tensorflow_v1.py",
        "if _tf_keras_builtin.is_layer(owner) else _keras2.capture(owner, name)",
        "if _tf_keras_builtin.is_layer(owner) else None",
        "tf1.15-keras2.3", ["tests/legacy/test_keras2.py"],
    ),
    Mutant(
        "tf1_gradient_not_ours", "in a TF1 graph the forward's gradient is TensorFlow's own (nothing is recomputed)",
        "keras_recompute/backends/tensorflow_v1.py", 'with graph.gradient_override_map({"IdentityN": gradient_name}):',
        "with contextlib.nullcontext():",
        "tf1.15-keras2.3", ["tests/legacy/test_keras2.py"],
    ),
    Mutant(
        "tf1_check_compares_nothing", "in a TF1 graph a recompute that computes another function is not caught",
        "keras_recompute/backends/tensorflow_v1.py", "expected = _Expected(out_leaves, heads, keep_values=check)",
        "expected = _Expected(out_leaves, heads, keep_values=False)",
        "tf1.15-keras2.3", ["tests/legacy/test_keras2.py::test_the_recompute_is_checked"],
    ),
    Mutant(
        "tf20_closed_over_graph_not_read", "on TensorFlow 2.0 (no op callbacks) a tf.function's forward is not read "
        "from its graph: a tensor the call closes over gets no gradient",
        "keras_recompute/backends/tensorflow.py", "for key in sorted(key for key in nodes if key > first):",
        "for key in ():",
        "tf2.0-keras2.3", ["tests/legacy/test_tf_keras.py::test_a_tensor_a_decorated_function_closes_over_gets_its_gradient"],
    ),
    Mutant(
        "tf20_closure_cells_not_taken", "on TensorFlow 2.0 in eager mode the tensors a decorated function closes over "
        "are not taken: their gradient is lost",
        "keras_recompute/backends/tensorflow.py", "for cell in getattr(function, \"__closure__\", None) or ():",
        "for cell in ():",
        "tf2.0-keras2.3", ["tests/legacy/test_tf_keras.py::test_a_tensor_a_decorated_function_closes_over_gets_its_gradient"],
    ),
    Mutant(
        "tf20_globals_not_taken", "on TensorFlow 2.0 in eager mode the globals a decorated function reads are not "
        "taken: a training script's module-level tensor gets no gradient",
        "keras_recompute/backends/tensorflow.py", "namespace = getattr(function, \"__globals__\", None) or {}",
        "namespace = {}",
        "tf2.0-keras2.3", ["tests/legacy/test_tf_keras.py::test_a_tensor_read_as_a_global_or_from_a_list_attribute_gets_its_gradient"],
    ),
    Mutant(
        "tf20_lists_not_searched", "on TensorFlow 2.0 in eager mode a tensor in a list set on the layer is not taken: "
        "its gradient is lost",
        "keras_recompute/backends/tensorflow.py", "if isinstance(value, (list, tuple, dict, collections.abc.Mapping)):",
        "if False:",
        "tf2.0-keras2.3", ["tests/legacy/test_tf_keras.py::test_a_tensor_read_as_a_global_or_from_a_list_attribute_gets_its_gradient"],
    ),
    # Planning and verify.
    Mutant(
        "budget_ignores_transients", "the solver leaves out what a unit holds while it recomputes",
        "keras_recompute/_budget.py", "if total + option.transient + held > room or forward > room:",
        "if total + held > room or forward > room:",
        "tensorflow", ["test_budget_solver.py"],
    ),
    Mutant(
        "measured_kept_past_a_change_around_the_units", "what a report measured is kept after a layer outside its "
        "units starts recomputing: the plan is made from figures of another step",
        "keras_recompute/_memory.py", "        recomputing_elsewhere(model, units),\n", "        (),\n",
        "torch", ["test_budget.py::test_a_model_changed_around_its_units_is_measured_again"],
    ),
    Mutant(
        "jax_unit_timed_on_a_sum", "each option's unit step on JAX is timed on the gradient of the outputs' sum, a "
        "constant from which XLA folds the recompute's wait and merges the recompute into the forward",
        "keras_recompute/backends/jax.py", "return sum(0.5 * jnp.sum(jnp.square(o.astype(jnp.float32))) for o in",
        "return sum(jnp.sum(o.astype(jnp.float32)) for o in",
        "jax", ["test_budget.py::test_each_options_timed_step_runs_its_recompute"],
    ),
    Mutant(
        "tf_unit_timed_on_a_sum", "each option's unit step on TensorFlow is timed on the gradient of the outputs' sum, "
        "a constant from which Grappler folds the recompute's wait and merges part of the recompute into the forward",
        "keras_recompute/backends/tensorflow.py", "            loss = scale * tf.add_n(sums)",
        "            loss = tf.add_n(sums)",
        "tensorflow", ["test_budget.py::test_each_options_timed_step_runs_its_recompute"],
    ),
    Mutant(
        "fit_plan_falls_back_on_asked_options_only", "largest_fit's plan falls back only on the options asked for "
        "beside it, so a plan asked for alone stops short of where one policy on every unit fits",
        "keras_recompute/_model.py",
        "fallback = [option for option in _uniform_options(costs) if option not in ruled_out]",
        "fallback = []",
        "jax", ["test_fit.py::test_a_plan_answered_alone_falls_back_on_every_option"],
    ),
    Mutant(
        "fit_plan_alone_not_measured_nearer", "largest_fit asked for the plan alone answers along the sequence from "
        "the quadratic through 64-256, far past them, not measured again at its answer",
        "keras_recompute/_fit.py",
        'answers = answers or [row["largest"] for row in rows if row["largest"]]',
        "answers = answers",
        "tensorflow", ["test_fit.py::test_a_plan_asked_for_alone_is_measured_again_past_the_sizes_measured"],
    ),
    Mutant(
        "verify_excess_precision_not_turned_off", "verify compiles a bfloat16 step on JAX again without turning "
        "XLA's excess precision off (and could pass a difference that is not its rounding, or not tell)",
        "keras_recompute/_verify.py",
        "compiler_options={_EXCESS_PRECISION_OPTION: False}",
        "compiler_options={}",
        "jax", ["test_verify.py::test_a_bfloat16_step_on_jax_is_compared_again_with_xlas_excess_precision_off"],
    ),
    Mutant(
        "budget_trusts_its_quanta", "the solver returns a plan without checking its peak against the budget",
        "keras_recompute/_budget.py", "if model.peak(list(choices)) <= budget:", "if True:",
        "tensorflow", ["test_budget_solver.py"],
    ),
    Mutant(
        "largest_fit_ignores_headroom", "largest_fit's predicted peak is held to the whole budget, its headroom left out",
        "keras_recompute/_fit.py", "    return budget - headroom * max(0.0, budget - fixed)", "    return budget",
        "tensorflow", ["test_fit_solver.py", "test_fit.py"],
    ),
    Mutant(
        "largest_fit_stops_a_step_short", "the search for the largest size that fits stops one step short",
        "keras_recompute/_fit.py", "    while high - low > step:", "    while high - low > 2 * step:",
        "tensorflow", ["test_fit_solver.py", "test_fit.py"],
    ),
    Mutant(
        "tf_forward_mode_recomputes", "a recomputed call inside a ForwardAccumulator recomputes (its JVP None or zero: "
        "NOTE [ forward-mode differentiation ])",
        "keras_recompute/backends/tensorflow.py", "    if forward_accumulator_active():", "    if False:",
        "tensorflow", ["test_forward_mode.py"],
    ),
    Mutant(
        "tf_closed_over_tensor_not_an_input", "a tensor a recomputed call reads without taking it is no input of the "
        "custom gradient (the layers that made it get no gradient: NOTE [ tensors a call closes over ])",
        "keras_recompute/backends/tensorflow.py", "    closed = closure.tensors()", "    closed = []",
        "tensorflow", ["test_tensorflow.py::test_a_tensor_the_call_reads_as_an_attribute_gets_its_gradient",
                       "test_tensorflow.py::test_a_tensor_a_decorated_function_closes_over_gets_its_gradient"],
    ),
    Mutant(
        "tf_op_callbacks_off_for_every_thread", "a thread leaving its recompute switches TensorFlow's eager slow-path "
        "op callbacks off for every thread (another replica's closed-over tensor unseen: NOTE [ op callbacks in threads ])",
        "keras_recompute/backends/_tf_private.py", "            _remove_op_callback(seen)",
        "            _op_callbacks.remove_op_callback(seen)",
        "tensorflow", ["test_tensorflow.py::test_a_tensor_closed_over_is_seen_while_another_thread_leaves_its_recompute"],
    ),
    Mutant(
        "jax_forward_mode_not_seen", "a JVP through a recomputed call is taken as reverse mode (JAX's custom_vjp error)",
        "keras_recompute/backends/jax.py",
        "    return isinstance(_jax_private_core.find_top_trace(values), _jax_ad.JVPTrace)", "    return False",
        "jax", ["test_forward_mode.py"],
    ),
    Mutant(
        "verify_passes_everything", "verify calls every weight's update within the plain step's spread",
        "keras_recompute/_verify.py",
        "exact = [d <= max(2 * s, _REASSOCIATION * scale) for d, s in zip(differences, spreads)]",
        "exact = [True for d in differences]",
        "torch", ["test_verify.py"],
    ),
]


# CI's selection (`--quick`, after the legacy command and the examples, at the lowest priority: `.ci/run`): one or
# two of each kind of silent wrong update, on every path, each killed in seconds (about 3 minutes in all on 2 cores;
# every mutant with its control takes 20). A test changed so that it no longer catches one of these fails CI.
QUICK = (
    "tf_gradient_doubled", "tf_kept_matmul_reads_weights_again", "tf_recompute_reads_weights_again",
    "tf_keras_state_not_replayed", "jax_backward_doubled", "jax_masks_not_attached", "attention_core_recomputes_nothing",
    "torch_keras_state_not_replayed", "torch_replay_leaves_seed_generator", "torch_inputs_not_copied",
    "torch_check_compares_nothing", "decorating_twice_recomputes_twice", "environment_variable_ignored",
    "budget_ignores_transients", "budget_trusts_its_quanta", "verify_passes_everything",
    "tf1_recompute_reads_weights_again", "tf1_gradient_not_ours", "tf_forward_mode_recomputes",
    "tf_closed_over_tensor_not_an_input", "tf20_closed_over_graph_not_read",
)


def _tensorflow_run_only():
    """The test files `tests/conftest.py` collects in the TensorFlow run only."""
    import ast

    with open(os.path.join(ROOT, "tests", "conftest.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_TENSORFLOW_RUN_ONLY" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise RuntimeError("tests/conftest.py no longer names _TENSORFLOW_RUN_ONLY: update tests/mutants.py")


def _installed(backend):
    import importlib.util

    if backend in LEGACY:
        return _legacy_runner().find_python() is not None
    return importlib.util.find_spec(backend) is not None and importlib.util.find_spec("keras") is not None


def _legacy_runner():
    import importlib.util

    spec = importlib.util.spec_from_file_location("legacy_run", os.path.join(ROOT, "tests", "legacy", "run.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_PYTHONS = {}


def _lane(root, backend):
    """`(python, working directory, environment)` of a run of `backend`'s tests in the copy at `root`."""
    if backend not in _PYTHONS:
        if backend in LEGACY:
            runner = _legacy_runner()
            cache = os.path.join(os.path.expanduser("~"), ".cache", "keras_recompute", "legacy")
            _PYTHONS[backend] = os.path.join(runner.environment(runner.find_python(), backend, cache), "python")
        else:
            _PYTHONS[backend] = sys.executable
    legacy = backend in LEGACY
    env = dict(os.environ, KERAS_BACKEND="tensorflow" if legacy else backend, **ENVIRONMENTS.get(backend, {}))
    if legacy:
        env["PYTHONNOUSERSITE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return _PYTHONS[backend], root if legacy else os.path.join(root, "tests"), env


def _copy(destination):
    ignore = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", ".whl", ".pytest_cache")
    shutil.copytree(ROOT, destination, ignore=ignore)


def _run(root, backend, tests, timeout):
    """`(outcome, seconds, first failure)` of `pytest -x tests` in the copy at `root`."""
    python, cwd, env = _lane(root, backend)
    command = [python, "-m", "pytest", *tests, "-x", "-q", "-p", "no:cacheprovider", "-W", "ignore"]
    start = time.time()
    try:
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.time() - start, None
    seconds = time.time() - start
    failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode in (0, 5) and " passed" not in summary:  # all skipped or deselected: nothing was tried
        return "no test ran", seconds, summary
    if done.returncode == 0:
        return "passed", seconds, None
    if done.returncode == 1 and failed:
        return "failed", seconds, failed[0][:300]
    return f"error (pytest exit {done.returncode})", seconds, done.stdout[-600:] + done.stderr[-600:]


def _imports_from(root, backend):
    python, cwd, env = _lane(root, backend)
    done = subprocess.run([python, "-c", "import keras_recompute; print(keras_recompute.__file__)"],
                          cwd=cwd, env=env, capture_output=True, text=True)
    return done.stdout.strip()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="mutants to run, by name (default: all)")
    parser.add_argument("--quick", action="store_true", help="CI's selection (QUICK): a few of each kind, fast")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for one mutant's tests")
    parser.add_argument("--control", action="store_true", help="also run each selection on an unmutated copy")
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args(argv)

    unknown = set(args.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"no mutant named {', '.join(sorted(unknown))}; the mutants: {', '.join(m.name for m in MUTANTS)}")
    if args.quick and args.only:
        parser.error("--quick is a selection of its own: give --quick or --only, not both")
    wanted = QUICK if args.quick else args.only
    chosen = [m for m in MUTANTS if not wanted or m.name in wanted]
    work = tempfile.mkdtemp(prefix="keras_recompute_mutants_")
    results, jobs = {}, []
    try:
        control = os.path.join(work, "control")
        _copy(control)
        for mutant in chosen:
            if not _installed(mutant.backend):
                results[mutant.name] = {"outcome": f"skipped ({mutant.backend} is not installed)"}
                continue
            why = mutant.problem(control)
            if why:
                results[mutant.name] = {"outcome": "stale", "why": why}
                continue
            root = os.path.join(work, mutant.name)
            _copy(root)
            mutant.apply(root)
            imported = _imports_from(root, mutant.backend)
            if not imported.startswith(root):
                raise SystemExit(f"the copy's keras_recompute is not the one imported ({imported!r}): is it "
                                 "installed otherwise than editable (pip install -e .)?")
            jobs.append((mutant, root))
        controls = sorted({(m.backend, tuple(m.tests)) for m, _ in jobs})
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            control_runs = {key: pool.submit(_run, control, key[0], list(key[1]), args.timeout) for key in controls
                            if args.control}
            mutant_runs = {m.name: pool.submit(_run, root, m.backend, m.tests, args.timeout) for m, root in jobs}
            for mutant, _ in jobs:
                outcome, seconds, failure = mutant_runs[mutant.name].result()
                key = (mutant.backend, tuple(mutant.tests))
                plain, plain_seconds, plain_failure = control_runs[key].result() if key in control_runs else (
                    "passed", None, None)
                if plain != "passed":
                    verdict = f"no control (unmutated: {plain})"
                else:
                    verdict = {"failed": "killed", "passed": "SURVIVED"}.get(outcome, outcome)
                results[mutant.name] = {
                    "outcome": verdict, "what": mutant.what, "backend": mutant.backend, "tests": mutant.tests,
                    "seconds": round(seconds, 1), "control_seconds": plain_seconds and round(plain_seconds, 1),
                    "caught_by": failure if outcome == "failed" else None,
                    "control_failure": plain_failure if plain != "passed" else None,
                }
                print(f"{mutant.name:40s} {verdict:10s} {seconds:6.0f} s  {failure or ''}"[:240], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    for name, row in results.items():
        if row["outcome"] in ("stale",) or row["outcome"].startswith("skipped"):
            print(f"{name:40s} {row['outcome']}  {row.get('why', '')}")
    killed = sum(r["outcome"] == "killed" for r in results.values())
    survivors = [n for n, r in results.items() if r["outcome"] != "killed" and not r["outcome"].startswith("skipped")]
    print(f"{killed} of {len(results)} killed" + (f"; not killed: {', '.join(survivors)}" if survivors else ""))
    if args.out:
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        import _record

        record = _record.metadata(argv=["tests/mutants.py"] + list(sys.argv[1:] if argv is None else argv))
        skipped = [n for n, r in results.items() if r["outcome"].startswith("skipped")]
        record.update(summary={"killed": killed, "mutants": len(results), "not_killed": survivors, "skipped": skipped},
                      results=results)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
