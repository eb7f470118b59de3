"""One-line breakages of the product, each with the tests that must fail when it is applied.

    .venv/bin/python checks/mutations.py              # every entry (its time on 2 cores: docs/measurements.md)
    .venv/bin/python checks/mutations.py -k recipe    # the entries whose path or original text holds "recipe"
    .venv/bin/python checks/mutations.py -t two_ranks # the entries that name a test holding "two_ranks"
    .venv/bin/python checks/mutations.py --list       # the entries, without running anything
    .venv/bin/python checks/mutations.py --check      # in seconds: every entry applies, its tests exist
    .venv/bin/python checks/mutations.py --sample 40  # 40 entries spread over the list: an estimate of the whole

The working tree (its tracked files and the untracked ones git does not ignore) is copied into a
temporary folder, one copy for each of the -j entries that run at once (default 2, one per core of
a 2-core machine); nothing here is changed. First the named tests of the selected entries run there
unchanged, their files shared out among the copies (they must pass: a test that fails anyway
proves nothing; --no-baseline skips this). Then, for each entry, the one change is made in a copy,
its tests run there with this repository's .venv (one pytest, stopping at the first failure, only
the tests named), and the file is put back. Each pytest is a fork of checks/warm_pytest.py, a
Python of the .venv that has imported torch, torchvision and pytest once (a new Python spends some
5 CPU seconds on them, per entry; --cold starts one anyway). The report is a table: each mutation, its tests, and "caught" (pytest
reported a failed test of behaviour), "survived" (they passed) or "error" (they could not run: a
test name that does not exist, a mutation that breaks the import); exit code 0 when every one was
caught.

An entry is ("path", "original", "replacement", ["tests/test_x.py::test_name", ...]): the original
text must occur exactly once in the file (several lines if one is not enough to be unique), and
each test it names must exist; an entry that does not apply is refused before anything runs.
--check makes these checks alone, for every entry, in seconds, and runs nothing (CI runs it: an
edit of a listed line shows there, not an hour into the mutation check; a check of source text
inside the test suite would fail on any edit of such a line, right or wrong, and catch nothing).
A new feature adds the mutation that switches it off, with the tests that catch it.

GPU entries: a name "gpu:KEY" among an entry's tests is the check KEY of `make test-gpu`
(checks/gpu_selftest.py --only KEY, caught when report.json says it FAILED). On a machine with a
CUDA GPU they run after the entry's tests (the baseline runs the named checks once, unchanged);
on one without, they are skipped: an entry that names GPU checks only is reported "no GPU" and
counts as neither caught nor survived (--gpu selects the GPU entries alone).
"""
import argparse
import contextlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv" / "bin" / "python"
GPU = "gpu:"  # the prefix of a check of make test-gpu among an entry's tests

MUTATIONS = [
    # Seven breakages the suite once let through.
    ("src/checkpoint.py", "if is_best:", "if True:",
     ["tests/test_recipe.py::test_save_epoch_writes_best_pth_only_for_a_better_epoch_by_best_by",
      "tests/test_recipe.py::test_an_epoch_that_is_no_better_keeps_best_pth"]),
    ("src/checkpoint.py", "best, weights = best_choice(history, args.best_by)",
     'best, weights = best_choice(history, "val_acc")',
     ["tests/test_recipe.py::test_save_epoch_writes_best_pth_only_for_a_better_epoch_by_best_by"]),
    ("src/freeze.py", "model.requires_grad_(not frozen)", "model.requires_grad_(True)",
     ["tests/test_one_step.py::test_a_frozen_stage_trains_the_head_alone_with_the_backbone_in_eval_mode"]),
    ("train_single.py", "model.train(not frozen)", "model.train(True)",
     ["tests/test_one_step.py::test_a_frozen_stage_trains_the_head_alone_with_the_backbone_in_eval_mode"]),
    ("src/recipe.py", "clip_grad_norm_(model.parameters(), clip_grad_norm)",
     "clip_grad_norm_(model.parameters(), 10 * clip_grad_norm)",
     ["tests/test_one_step.py::test_clipping_moves_the_weights_by_lr_times_the_norm"]),
    ("src/progress.py", 'record_function("data wait")', 'record_function("data_wait")',
     ["tests/test_benchmark.py::test_the_profile_finds_the_data_wait_the_loop_clocked",
      "tests/test_watch.py::test_profile_writes_a_trace_and_the_table"]),
    ("src/cli.py", 'help="SGD momentum, in [0, 1)"', "help=argparse.SUPPRESS",
     ["tests/test_train_single.py::test_help_lists_every_flag"]),
    ("src/cli.py", 'help="micro-batches of --batch-size per optimizer step (gradient accumulation)"',
     "help=argparse.SUPPRESS", ["tests/test_train_single.py::test_help_lists_every_flag"]),

    # Shared code against hand computations (tests/test_one_step.py), in every script.
    ("train_dp.py", "model.train(not frozen)", "model.train(True)",
     ["tests/test_one_step.py::test_a_frozen_stage_trains_the_head_alone_with_the_backbone_in_eval_mode"]),
    ("train_ddp.py", "model.train(not frozen)", "model.train(True)",
     ["tests/test_one_step.py::test_a_frozen_stage_trains_the_head_alone_with_the_backbone_in_eval_mode"]),
    ("train_accelerate.py", "model.train(not frozen)", "model.train(True)",
     ["tests/test_one_step.py::test_a_frozen_stage_trains_the_head_alone_with_the_backbone_in_eval_mode"]),
    ("train_single.py", "label_smoothing=args.label_smoothing", "label_smoothing=0.0",
     ["tests/test_one_step.py::test_one_step_is_the_hand_computed_step"]),
    ("train_dp.py", "label_smoothing=args.label_smoothing", "label_smoothing=0.0",
     ["tests/test_one_step.py::test_one_step_is_the_hand_computed_step"]),
    ("train_ddp.py", "label_smoothing=args.label_smoothing", "label_smoothing=0.0",
     ["tests/test_one_step.py::test_one_step_is_the_hand_computed_step"]),
    ("train_accelerate.py", "label_smoothing=args.label_smoothing", "label_smoothing=0.0",
     ["tests/test_one_step.py::test_one_step_is_the_hand_computed_step"]),
    ("src/recipe.py", '"weight_decay": args.weight_decay}', '"weight_decay": 2 * args.weight_decay}',
     ["tests/test_one_step.py::test_one_step_is_the_hand_computed_step"]),
    ("src/recipe.py", '"weight_decay": 0.0}', '"weight_decay": args.weight_decay}',
     ["tests/test_one_step.py::test_one_step_is_the_hand_computed_step"]),
    ("train_single.py", "scaler.scale(loss / args.accumulate)", "scaler.scale(loss)",
     ["tests/test_one_step.py::test_one_step_is_the_hand_computed_step"]),
    ("train_ddp.py", "scaler.scale(loss / args.accumulate)", "scaler.scale(loss)",
     ["tests/test_one_step.py::test_one_step_is_the_hand_computed_step"]),
    ("src/cli.py", "return getattr(torch, name) if name else None", "return None",
     ["tests/test_one_step.py::test_amp_runs_the_forward_in_its_dtype_and_keeps_float32_weights"]),
    ("train_single.py", 'enabled=args.amp != "no"):\n            logits = model(inputs)\n            loss',
     'enabled=False):\n            logits = model(inputs)\n            loss',
     ["tests/test_one_step.py::test_amp_runs_the_forward_in_its_dtype_and_keeps_float32_weights",
      "tests/test_performance.py::test_bf16_really_runs_in_bf16_in_single_and_accelerate"]),
    ("train_dp.py", 'scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")',
     "scaler = torch.amp.GradScaler(device.type, enabled=False)",
     ["tests/test_performance.py::test_fp16_scales_the_loss_and_stays_near_float32"]),
    ("src/accelerate_checks.py", 'if accelerator.mixed_precision == "fp16" and not accelerator.native_amp:',
     "if False:", ["tests/test_one_step.py::test_accelerate_with_fp16_on_a_cpu_is_refused"]),

    # Tests that were once too weak to catch these.
    ('train_ddp.py', 'sampler=ShardSampler(len(val_set), world_size, rank)',
     'sampler=DistributedSampler(val_set, world_size, rank, shuffle=False)',
     ['tests/test_loaders.py::test_validation_shards_cover_every_sample_once']),
    ("src/outputs.py", "os.fsync(raw.fileno())", "raw.fileno()",
     ["tests/test_reliability.py::test_a_checkpoint_is_on_disk_before_its_rename"]),
    ("src/outputs.py", "raw.flush()", "pass",
     ["tests/test_reliability.py::test_a_checkpoint_is_on_disk_before_its_rename"]),
    ("src/progress.py", "loss = (sums - before_sums)[LOSS].item() / max(seen, 1)",
     "loss = sums[LOSS].item() / max(seen, 1)",
     ["tests/test_watch.py::test_the_progress_bar_shows_the_recent_loss_and_images_per_second"]),
    ("src/tools/benchmark.py", 'last["train_samples"] / last["train_seconds"]', 'last["train_samples"] / last["seconds"]',
     ["tests/test_benchmark.py::test_the_benchmark_figures_are_those_of_its_runs"]),
    ("src/tools/benchmark.py", "{'x' if met else ' '}", "{'x'}",
     ["tests/test_benchmark.py::test_the_benchmark_figures_are_those_of_its_runs"]),
    ("src/tools/benchmark.py", "counted = -(-max_batches // max(workers, 1)) * max(workers, 1)",
     "counted = max_batches",
     ["tests/test_benchmark.py::test_loader_alone_counts_whole_rounds_of_workers",
      "tests/test_benchmark.py::test_loader_alone_measures_a_loader_of_known_speed"]),
    ("src/models.py", 'MIN_IMAGE_SIZE = {"alexnet": 63,', 'MIN_IMAGE_SIZE = {"alexnet": 70,',
     ["tests/test_arch_walk.py::test_sizes_a_model_cannot_take_are_refused_naming_the_size_it_needs"]),

    # What earlier releases claimed to catch.
    ('src/progress.py', 'state.data_wait += time.perf_counter() - start',
     'state.data_wait += 0.0 * (time.perf_counter() - start)',
     ['tests/test_watch.py::test_data_wait_grows_with_a_slow_loader_while_the_model_time_does_not']),
    ("src/transforms.py", "return torch.channels_last if channels_last else torch.preserve_format",
     "return torch.preserve_format",
     ["tests/test_performance.py::test_channels_last_and_compile_take_effect_and_change_nothing"]),
    ("src/transforms.py", "images = images.contiguous(memory_format=torch.channels_last)", "images = images",
     ["tests/test_gpu_on_cpu_host_syncs.py::test_channels_last_reaches_the_model_through_the_loop"]),
    ("train_single.py", "net = cast(nn.Module, torch.compile(stage.net)) if args.compile else stage.net", "net = stage.net",
     ["tests/test_performance.py::test_channels_last_and_compile_take_effect_and_change_nothing"]),
    ('train_ddp.py', '                train_loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]  # its DistributedSampler\n',
     '',
     ['tests/test_modes.py::test_two_processes_match_single_and_only_rank_0_writes_prints_and_scans']),
    ("src/metrics.py", ".clamp(EPS, 1 - EPS)", "",
     ["tests/test_modes.py::test_val_log_loss_is_kaggles_metric_clipped",
      "tests/test_modes.py::test_ddp_validation_metrics_are_what_one_process_computes"]),
    ("train_ddp.py", "    if rank == 0:\n        print(run_header(", "    if True:\n        print(run_header(",
     ["tests/test_modes.py::test_two_processes_match_single_and_only_rank_0_writes_prints_and_scans"]),
    ('src/state.py', '            if not is_first():  # rank 0 alone builds and writes last.pth: no collective in it\n                return False\n',
     '            if False:\n                return False\n',
     ['tests/test_modes.py::test_two_processes_match_single_and_only_rank_0_writes_prints_and_scans']),
    ("src/loaders.py", "table, val = from_rank_0(tables)", "table, val = tables()",
     ["tests/test_modes.py::test_two_processes_match_single_and_only_rank_0_writes_prints_and_scans"]),
    ("train_ddp.py", "with contextlib.nullcontext() if last else model.no_sync():", "with contextlib.nullcontext():",
     ["tests/test_recipe.py::test_ddp_all_reduces_the_gradients_once_per_optimizer_step"]),
    ("src/progress.py", "if log_dir and is_first():", "if log_dir:",
     ["tests/test_watch.py::test_tensorboard_holds_the_step_and_epoch_scalars_from_rank_0_only"]),
    ("src/data_parallel.py", "return [AutocastReplica(replica, self.src_device_obj.type) for replica in replicas]",
     "return replicas",
     ["tests/test_gpu_on_cpu_data_parallel.py::test_data_parallel_wraps_every_replica"]),
    ("src/transforms.py", "@functools.cache\n", "",
     ["tests/test_gpu_on_cpu_host_syncs.py::test_no_tensor_is_built_from_python_values_inside_a_step"]),
    ("src/data_parallel.py", "if args.compile and gpus > 1:", "if False:",
     ["tests/test_gpu_on_cpu_data_parallel.py::test_compile_with_data_parallel_on_two_gpus_is_refused"]),
    ("src/devices.py", "torch.backends.cudnn.deterministic = True", "pass",
     ["tests/test_gpu_on_cpu_numerics.py::test_deterministic_switches_off_tf32_and_nondeterministic_kernels"]),
    ("src/devices.py", "return max(1, min(cpus, math.ceil(quota))) if quota else cpus", "return cpus",
     ["tests/test_gpu_on_cpu_hosts.py::test_default_workers_follow_a_containers_cpu_quota"]),
    ("src/devices.py", "    if free < need:\n", "    if False:\n",
     ["tests/test_gpu_on_cpu_hosts.py::test_a_small_dev_shm_is_one_line_before_training"]),
    ('src/outputs.py', 'from_rank_0(lambda: held.append(_try_outputs(args)))',
     'None',
     ['tests/test_train_single.py::test_unwritable_output_folders_stop_before_training']),
    ("src/checkpoint.py", 'schedule.load_state_dict(state["schedule"])', "pass",
     ["tests/test_recipe.py::test_resume_in_the_middle_of_the_schedule_equals_the_straight_run"]),
    ("src/seeds.py", "torch.manual_seed(derive_seed(seed, epoch, rank))", "pass",
     ["tests/test_random_draws.py::test_each_epoch_seeds_the_global_generator_from_the_seed_and_the_epoch",
      "tests/test_reliability.py::test_ctrl_c_anywhere_then_resume_equals_the_straight_run"]),
    ("src/cache.py", 'if int(os.environ.get("LOCAL_RANK", 0)) != 0:', "if False:",
     ["tests/test_performance.py::test_a_process_waiting_for_a_cache_that_never_comes_stops_with_one_line",
      "tests/test_performance.py::test_ddp_ranks_share_one_cache_that_one_process_built_once"]),
    ("src/cache.py", 'f"{uuid.uuid4().hex[:8]}.tmp")', 'f"tmp")',
     ["tests/test_performance.py::test_the_first_complete_build_wins_and_builders_never_share_a_file"]),
    ("src/freeze.py", '{_weights_digest(model)}', "",
     ["tests/test_freeze.py::test_the_feature_cache_is_rebuilt_when_the_backbone_or_size_changes"]),
    ("src/plot.py", 'axes.plot(epochs, [r[f"val_{key}"] for r in history], "s-", label=f"Validation {title.lower()}")',
     "pass", ["tests/test_train_single.py::test_the_plot_holds_both_curves_of_every_epoch"]),
    ("src/inference.py", "p = (p + model(images.flip(dims=[3])).float().softmax(dim=1)) / 2",
     "p = p", ["tests/test_kaggle.py::test_tta_averages_each_image_with_its_mirror"]),
    ("src/augment.py", "derive_seed(seed, epoch, index)", "derive_seed(seed, 0, index)",
     ["tests/test_recipe.py::test_one_samples_augmentation_is_the_same_whatever_the_workers_or_the_rank"]),

    # This script's own refusal of an entry that does not apply (the text in two pieces: whole, it
    # would occur here too).
    ("checks/mutations.py", "if count " "!= 1:", "if count > 1:",
     ["tests/test_mutations.py::test_an_entry_that_does_not_apply_is_refused_before_anything_runs"]),
    # Caught only when a named test failed; a named test that does not exist is refused too.
    ("checks/mutations.py", 'if outcome == "failed" and ' 'failed:', 'if outcome == "failed":',
     ["tests/test_mutations.py::test_the_verdict_says_caught_only_when_pytest_named_a_failed_test"]),
    ("checks/mutations.py", 'return not name or f"def {name}(" ' 'in file.read_text()', "return True",
     ["tests/test_mutations.py::test_an_entry_that_does_not_apply_is_refused_before_anything_runs",
      "tests/test_mutations.py::test_check_reports_every_stale_entry_and_runs_nothing"]),
    ("checks/mutations.py", 'if line.startswith(("FAILED ", ' '"ERROR ")) and " " in line]',
     'if line.startswith("FAILED ") and " " in line]',
     ["tests/test_mutations.py::test_the_runner_reads_which_tests_failed_from_pytest"]),
    # The GPU path (fused optimizers, seeds, DataParallel, timeouts, caches, make test-gpu).
    ('src/recipe.py', '    optimizer.register_step_pre_hook(zero_momentum)\n', '',
     ['tests/test_gpu_on_cpu_fused_optimizers.py::test_fp16_with_the_gpus_fused_sgd_ends_where_plain_sgd_does', 'tests/test_gpu_on_cpu_fused_optimizers.py::test_fused_optimizers_survive_a_skipped_first_step', 'tests/test_gpu_on_cpu_fused_optimizers.py::test_fused_sgd_takes_a_backbone_unfrozen_after_its_head_trained', 'tests/test_gpu_on_cpu_selftest.py::test_make_test_gpus_fused_optimizer_check_bites']),
    ('src/recipe.py', '    fused = gpu_choices(device)', '    fused = False',
     ['tests/test_gpu_on_cpu_fused_optimizers.py::test_fp16_with_the_gpus_fused_sgd_ends_where_plain_sgd_does', 'tests/test_gpu_on_cpu_fused_optimizers.py::test_fp16_with_the_gpus_fused_adamw_ends_where_plain_adamw_does', 'tests/test_gpu_on_cpu_fused_optimizers.py::test_fused_optimizers_survive_a_skipped_first_step', 'tests/test_gpu_on_cpu_host_syncs.py::test_no_tensor_is_built_from_python_values_inside_a_step', 'tests/test_gpu_on_cpu_numerics.py::test_the_benchmarks_ceilings_run_as_the_runs_do']),
    ('src/devices.py', '    return switch == "1" if switch in ("0", "1") else device.type == "cuda"', '    return device.type == "cuda"',
     ['tests/test_gpu_on_cpu_fused_optimizers.py::test_fp16_with_the_gpus_fused_sgd_ends_where_plain_sgd_does', 'tests/test_gpu_on_cpu_host_syncs.py::test_no_tensor_is_built_from_python_values_inside_a_step', 'tests/test_gpu_on_cpu_fused_optimizers.py::test_fused_optimizers_survive_a_skipped_first_step']),
    ('src/recipe.py', '    schedule.step()\n', '    schedule.step() if not scaler.is_enabled() or scaler._growth_tracker.item() > 0 else None\n',
     ['tests/test_gpu_on_cpu_fused_optimizers.py::test_the_schedule_advances_at_every_optimizer_step_also_a_skipped_one', 'tests/test_gpu_on_cpu_fused_optimizers.py::test_optimizer_step_advances_the_schedule_when_the_scaler_skips']),
    ('train_accelerate.py', '            if accelerator.sync_gradients:\n                state.schedule.step()',
     '            if accelerator.sync_gradients and not state.optimizer.step_was_skipped:\n                state.schedule.step()',
     ['tests/test_gpu_on_cpu_fused_optimizers.py::test_the_schedule_advances_at_every_optimizer_step_also_a_skipped_one']),
    ('src/devices.py', '    processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))', '    processes = 1',
     ['tests/test_gpu_on_cpu_hosts.py::test_the_shared_memory_check_counts_every_process_of_the_node']),
    ('src/seeds.py', 'generator.manual_seed(derive_seed(seed, epoch, rank, gpu))', 'generator.manual_seed(derive_seed(seed, epoch, rank))',
     ['tests/test_gpu_on_cpu_data_parallel.py::test_each_gpu_draws_its_own_dropout_masks']),
    ('src/data_parallel.py', '            keep_memory_format(module, replica)', '            pass',
     ['tests/test_gpu_on_cpu_data_parallel.py::test_data_parallel_replicas_keep_channels_last_weights']),
    ('src/checkpoint.py', '    optimizer.load_state_dict({**saved, "param_groups": groups})', '    optimizer.load_state_dict(saved)\n    [group.update(kept) for group, kept in zip(optimizer.param_groups, kernels)]',
     ['tests/test_gpu_on_cpu_fused_optimizers.py::test_resume_places_a_cpu_checkpoints_adamw_state_for_fused_adamw']),
    ('src/checkpoint.py', '            load_optimizer(optimizer, state["optimizer"])',
     '            optimizer.load_state_dict(state["optimizer"])',
     ['tests/test_gpu_on_cpu_fused_optimizers.py::test_resume_places_a_cpu_checkpoints_adamw_state_for_fused_adamw']),
    ('train_ddp.py', 'timeout=dist_timeout(args.dist_timeout))  # a peer',
     'timeout=__import__("datetime").timedelta(minutes=10))  # a peer',
     ['tests/test_gpu_on_cpu_hosts.py::test_dist_timeout_sets_the_process_group_and_the_cache_wait']),
    ('train_accelerate.py', '        kwargs_handlers=[InitProcessGroupKwargs(timeout=dist_timeout(args.dist_timeout))])', '        kwargs_handlers=[InitProcessGroupKwargs()])',
     ['tests/test_gpu_on_cpu_hosts.py::test_dist_timeout_sets_the_process_group_and_the_cache_wait']),
    ('train_ddp.py', 'data = labelled_data(args, dist_timeout(args.dist_timeout).total_seconds())',
     'data = labelled_data(args)',
     ['tests/test_gpu_on_cpu_hosts.py::test_dist_timeout_sets_the_process_group_and_the_cache_wait']),
    ('src/cache.py', 'flag, WAIT_SECONDS if wait_seconds is None else wait_seconds)',
     'flag, WAIT_SECONDS)',
     ['tests/test_gpu_on_cpu_hosts.py::test_a_cache_wait_gives_up_after_dist_timeout']),
    ('src/cache.py', '    stem = f"train_{image_size}px.{key[:16]}"', '    stem = f"train_{image_size}px"',
     ['tests/test_gpu_on_cpu_hosts.py::test_nodes_with_other_copies_of_the_images_share_a_cache_folder']),
    ('train_accelerate.py', '    check_launch()  # guard: a sharding plugin asked for, more processes than GPUs, bf16 where a GPU lacks it\n    trackers = (["tensorboard"] if args.log_dir else []) + requested(args)  # --log-dir\'s, --track\'s\n    # split_batches: each loader batch of batch_size x processes is cut into one piece per process,\n    # so the global batches are those of train_single.py --batch-size (batch_size x processes).\n    # non_blocking: copies from the pinned batches do not make the host wait for the GPU.\n    accelerator = Accelerator(\n        gradient_accumulation_steps=args.accumulate, log_with=trackers or None,  # None: no warning of an empty list\n        project_dir=args.log_dir, step_scheduler_with_optimizer=False,\n        dataloader_config=DataLoaderConfiguration(split_batches=True, non_blocking=True),\n        kwargs_handlers=[InitProcessGroupKwargs(timeout=dist_timeout(args.dist_timeout))])  # as train_ddp.py\'s\n    check_accelerator(accelerator)  # guard: a launch where each process would train alone, fp16 without autocast\n    configure_numerics(args.deterministic)  # after Accelerator(), which sets TF32 for dynamo\n', '    check_launch()  # guard: a sharding plugin asked for, more processes than GPUs, bf16 where a GPU lacks it\n    configure_numerics(args.deterministic)\n    trackers = (["tensorboard"] if args.log_dir else []) + requested(args)  # --log-dir\'s, --track\'s\n    # split_batches: each loader batch of batch_size x processes is cut into one piece per process,\n    # so the global batches are those of train_single.py --batch-size (batch_size x processes).\n    # non_blocking: copies from the pinned batches do not make the host wait for the GPU.\n    accelerator = Accelerator(\n        gradient_accumulation_steps=args.accumulate, log_with=trackers or None,  # None: no warning of an empty list\n        project_dir=args.log_dir, step_scheduler_with_optimizer=False,\n        dataloader_config=DataLoaderConfiguration(split_batches=True, non_blocking=True),\n        kwargs_handlers=[InitProcessGroupKwargs(timeout=dist_timeout(args.dist_timeout))])  # as train_ddp.py\'s\n    check_accelerator(accelerator)  # guard: a launch where each process would train alone, fp16 without autocast\n',
     ['tests/test_gpu_on_cpu_numerics.py::test_deterministic_survives_accelerates_tf32_for_dynamo']),
    ('src/tools/benchmark.py', '    optimizer = make_optimizer(model, script_args("", []), device)', '    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)',
     ['tests/test_gpu_on_cpu_numerics.py::test_the_benchmarks_ceilings_run_as_the_runs_do']),
    ('src/tools/benchmark.py', '    configure_numerics(False)\n', '',
     ['tests/test_gpu_on_cpu_numerics.py::test_the_benchmarks_ceilings_run_as_the_runs_do']),
    ('src/devices.py', '    if torch.cuda.is_available() and local_processes > gpus and not gpus_shared():', '    if torch.cuda.is_available() and local_processes > gpus:',
     ['tests/test_gpu_on_cpu_hosts.py::test_several_processes_may_share_a_gpu_when_asked']),
    ('src/devices.py', '    gpu = local_rank % torch.cuda.device_count() if gpus_shared() else local_rank', '    gpu = local_rank',
     ['tests/test_gpu_on_cpu_hosts.py::test_several_processes_may_share_a_gpu_when_asked']),
    ('src/devices.py', '    return "nccl" if device.type == "cuda" and not gpus_shared() else "gloo"', '    return "nccl" if device.type == "cuda" else "gloo"',
     ['tests/test_gpu_on_cpu_hosts.py::test_several_processes_may_share_a_gpu_when_asked']),
    ('tests/hooks/sitecustomize.py', '                flag.fill_(1.0)', '                pass',
     ['tests/test_gpu_on_cpu_fused_optimizers.py::test_fp16_with_the_gpus_fused_sgd_ends_where_plain_sgd_does']),
    ('tests/hooks/sitecustomize.py', '                self.native_amp, self.scaler = True, torch.amp.GradScaler("cpu")', '                pass',
     ['tests/test_gpu_on_cpu_fused_optimizers.py::test_fp16_with_the_gpus_fused_sgd_ends_where_plain_sgd_does']),
    ('src/freeze.py', '            if previous is not None:\n                _store(array, *previous)\n\n        ensure_array', '            pass\n\n        ensure_array',
     ['tests/test_freeze.py::test_the_feature_cache_trains_the_same_head_as_the_images']),
    ('checks/gpu_selftest.py', 'START_UP, COMPILED, IN_PROCESS, DATA = 20, 40, 20, 5', 'START_UP, COMPILED, IN_PROCESS, DATA = 25, 40, 20, 5',
     ['tests/test_gpu_on_cpu_selftest.py::test_make_test_gpu_is_planned_within_its_time_and_dev_shm',
      'tests/test_gpu_selftest_logic.py::test_the_plan_fits_the_proofs_deadline_at_half_the_speed']),
    ('checks/gpu_selftest.py', 'PARALLEL = 4  # launches at once', 'PARALLEL = 1  # launches at once',
     ['tests/test_gpu_on_cpu_selftest.py::test_make_test_gpu_is_planned_within_its_time_and_dev_shm']),
    # predict, --evaluate, ONNX export.
    ('src/image_files.py', '                walk(entry.path, f"{relative}{entry.name}/")', '                pass',
     ['tests/test_predict.py::test_a_mixed_folder_gives_the_validation_pass_p_dog']),
    ('src/image_files.py', 'found = [path / name for name in sorted(files_under(path), key=natural_key)]',
     'found = [path / name for name in sorted(files_under(path))]',
     ['tests/test_predict.py::test_a_mixed_folder_gives_the_validation_pass_p_dog']),
    ('src/image_files.py', '                others.append(file)', '                pass',
     ['tests/test_predict.py::test_a_mixed_folder_gives_the_validation_pass_p_dog']),
    ('src/image_files.py', '            elif os.path.realpath(file) not in seen:', '            elif True:',
     ['tests/test_predict.py::test_find_images_counts_other_files_and_refuses_an_empty_folder']),
    ('src/image_files.py', '        image.draft("RGB", (size, size))  # libjpeg', '        pass  # libjpeg',
     ['tests/test_predict.py::test_decode_is_the_training_decode_byte_for_byte']),
    ('src/inference.py', '    sampler = ShardSampler(len(files), world_size, rank)', '    sampler = ShardSampler(len(files))',
     ['tests/test_predict.py::test_two_processes_under_torchrun_write_the_one_process_csv']),
    ('src/inference.py', 'return torch.cat([s for s, _ in shares])', 'return torch.cat([s for s, _ in reversed(shares)])',
     ['tests/test_predict.py::test_two_processes_under_torchrun_write_the_one_process_csv']),
    ('src/inference.py', '    share[[i - sampler.start for i in broken]] = float("nan")', '    pass',
     ['tests/test_predict.py::test_the_rows_of_files_that_cannot_be_decoded_are_nan',
      'tests/test_predict.py::test_a_mixed_folder_gives_the_validation_pass_p_dog']),
    ('src/tools/predict.py', 'amp_dtype(args.amp), args.channels_last, rank, world_size)', 'None, args.channels_last, rank, world_size)',
     ['tests/test_predict.py::test_tta_amp_and_channels_last_are_applied']),
    ('src/tools/predict.py', '            model.to(device).to(memory_format=memory_format(args.channels_last))',
     '            model.to(device)',
     ['tests/test_predict.py::test_tta_amp_and_channels_last_are_applied']),
    ('src/tools/predict.py', '                from_rank_0(lambda: check_output(args, files))',
     '                pass',
     ['tests/test_predict.py::test_bad_input_ends_in_one_line_before_any_work']),
    ('src/tools/predict.py', '        check_complete(result.files, result.broken)', '        pass',
     ['tests/test_predict.py::test_kaggle_test_folder_with_a_broken_image_is_refused']),
    ('src/tools/predict.py', '[str(file), f"{p[dog]:.6g}", result.classes[int(p.argmax())]]', '[str(file), f"{p[1 - dog]:.6g}", result.classes[int(p.argmax())]]',
     ['tests/test_predict.py::test_a_mixed_folder_gives_the_validation_pass_p_dog']),
    ('src/cli.py', 'evaluate_file = args.weights if args.weights not in ("default", "none") else args.checkpoint', 'evaluate_file = args.checkpoint',
     ['tests/test_evaluate.py::test_evaluate_reproduces_the_epoch_and_writes_nothing']),
    ('src/cli.py', '        for flag in ("resume", "overwrite", "cache", "log_dir", "profile", "track", "save_every_steps"):', '        for flag in ():',
     ['tests/test_evaluate.py::test_evaluate_refuses_flags_that_write']),
    ('train_single.py', '        evaluated, start = load_evaluated(args, info, model), time.time()', '        evaluated, start = str(args.evaluate_file), time.time()',
     ['tests/test_evaluate.py::test_evaluate_reproduces_the_epoch_and_writes_nothing']),
    ('train_dp.py', '        evaluated, start = load_evaluated(args, info, model), time.time()', '        evaluated, start = str(args.evaluate_file), time.time()',
     ['tests/test_evaluate.py::test_evaluate_reproduces_the_epoch_and_writes_nothing']),
    ('train_ddp.py', '        evaluated, start = load_evaluated(args, info, model), time.time()', '        evaluated, start = str(args.evaluate_file), time.time()',
     ['tests/test_evaluate.py::test_evaluate_under_torchrun_and_accelerate_is_exact_and_rank_0_alone_speaks']),
    ('train_accelerate.py', '        evaluated, start = load_evaluated(args, info, model), time.time()', '        evaluated, start = str(args.evaluate_file), time.time()',
     ['tests/test_evaluate.py::test_evaluate_under_torchrun_and_accelerate_is_exact_and_rank_0_alone_speaks']),
    ('train_ddp.py', "    dist.all_reduce(sums)  # every rank's sums: each validation sample is in exactly one shard", '    pass',
     ['tests/test_evaluate.py::test_evaluate_under_torchrun_and_accelerate_is_exact_and_rank_0_alone_speaks']),
    ('src/outputs.py', '    if not args.evaluate:\n        from src.ranks',
     '    if True:\n        from src.ranks',
     ['tests/test_evaluate.py::test_evaluate_reproduces_the_epoch_and_writes_nothing', 'tests/test_evaluate.py::test_evaluate_under_torchrun_and_accelerate_is_exact_and_rank_0_alone_speaks']),
    ('src/inference.py', '            if saved.get(key) != info[key]:', '            if False:',
     ['tests/test_evaluate.py::test_evaluate_refuses_a_checkpoint_of_other_flags']),
    ('src/inference.py', '    if "sha256" in info and sha256_of(checkpoint) != info["sha256"]:', '    if False:',
     ['tests/test_evaluate.py::test_evaluate_refuses_a_best_json_of_another_best_pth', 'tests/test_predict.py::test_a_checkpoint_of_another_arch_or_class_count_or_a_torn_pair']),
    ('src/inference.py', '    if is_first():\n        record = evaluation_record(val_sums, seconds)', '    if True:\n        record = evaluation_record(val_sums, seconds)',
     ['tests/test_evaluate.py::test_evaluate_under_torchrun_and_accelerate_is_exact_and_rank_0_alone_speaks']),
    ('src/tools/export.py', '        return self.model((images.float() / 255 - self.mean) / self.std).float().softmax(dim=1)', '        return self.model(images.float() / 255).float().softmax(dim=1)',
     ['tests/test_export.py::test_the_export_states_its_contract_and_its_check']),
    ('src/tools/export.py', '        dynamic_shapes={"images": {0: torch.export.Dim("batch")}})', '        )',
     ['tests/test_export.py::test_the_export_states_its_contract_and_its_check']),
    ('src/tools/export.py', '    program.model.metadata_props.update(metadata(info))', '    pass',
     ['tests/test_export.py::test_the_export_states_its_contract_and_its_check']),
    ('src/tools/export.py', '    if ratio[worst] > 1:', '    if False:',
     ['tests/test_export.py::test_a_wrong_export_is_refused_and_nothing_written']),
    ('src/tools/export.py', '        put_in_place(folder, output)\n    except OSError as error:  # a full disk: the old file stays\n        raise UserError(cannot_write(output, error)) from None\n    finally:\n', '    except OSError as error:  # a full disk: the old file stays\n        raise UserError(cannot_write(output, error)) from None\n    finally:\n        put_in_place(folder, output)\n',
     ['tests/test_export.py::test_a_wrong_export_is_refused_and_nothing_written']),
    ('src/tools/onnx_model.py', '    if info.get("sha256") != meta["best_pth_sha256"]:', '    if False:',
     ['tests/test_export.py::test_an_onnx_file_of_another_model_is_refused']),
    ('src/tools/predict.py', '    best_json = None if args.checkpoint is None and not described.is_file() else described', '    best_json = described',
     ['tests/test_export.py::test_predict_onnx_runs_without_torch_and_gives_torchs_p_dog']),
    ('src/tools/predict.py', '    best_json = None if args.checkpoint is None and not described.is_file() else described', '    best_json = None',
     ['tests/test_export.py::test_an_onnx_file_of_another_model_is_refused']),
    ('src/tools/predict.py', 'p = (p + session.run(None, {"images": np.ascontiguousarray(batch[..., ::-1])})[0]) / 2', 'p = (p + session.run(None, {"images": batch})[0]) / 2',
     ['tests/test_export.py::test_predict_onnx_tta_averages_the_mirror_images']),
    ('src/tools/predict.py', 'import numpy as np\n', 'import numpy as np\nimport torch  # noqa: F401\n',
     ['tests/test_export.py::test_predict_onnx_runs_without_torch_and_gives_torchs_p_dog']),
    ('src/tools/rounding.py', 'LAMBDA = 3.0', 'LAMBDA = 3000.0',
     ['tests/test_export.py::test_onnxruntime_matches_torch_on_real_images_within_the_bound']),
    # Resume wherever rank 0 lands, one-line errors, ignored outputs.
    ('src/checkpoint.py', 'source = -max(held)[1]', 'source = 0',
     ['tests/test_modes.py::test_rank_0_on_another_machine_resumes_the_run_and_gets_its_files']),
    ('src/checkpoint.py', '    if source != 0 and "shards" not in state:', '    if False:',
     ['tests/test_modes.py::test_rank_0_on_another_machine_resumes_the_run_and_gets_its_files']),
    ('train_accelerate.py', '    if accelerator.is_main_process:\n        print(run_header', '    if accelerator.is_local_main_process:\n        print(run_header',
     ['tests/test_modes.py::test_rank_0_on_another_machine_resumes_the_run_and_gets_its_files']),
    ('src/errors.py', '        time.sleep(60)', '        pass',
     ['tests/test_ranks_agree.py::test_a_quiet_rank_waits_for_the_launcher_and_rank_0_does_not',
      'tests/test_modes.py::test_a_bad_flag_under_torchrun_is_reported_once']),
    ('src/models.py', 'with contextlib.redirect_stdout(io.StringIO()) as said:', 'with contextlib.nullcontext(io.StringIO()) as said:',
     ['tests/test_models.py::test_default_weights_offline_is_one_line']),
    ('src/checkpoint.py', 'return "torchvision\'s default"', 'return "None"',
     ['tests/test_reliability.py::test_resume_refuses_another_run']),
    ('src/tools/compare_recipes.py', "if share >= 0.01 else 'under 1%'", "if True else 'under 1%'",
     ['tests/test_compare_recipes.py::test_verdict_says_how_much_lower_in_words_that_hold']),
    ('src/tools/compare_recipes.py', 'if f"{a:.4f}" == f"{b:.4f}":', 'if a == b:',
     ['tests/test_compare_recipes.py::test_verdict_says_how_much_lower_in_words_that_hold']),
    ('src/outputs.py', '    with tempfile.TemporaryFile(dir=folder):\n        pass\n', '',
     ['tests/test_train_single.py::test_unwritable_output_folders_stop_before_training']),
    ('.gitignore', '/cache/', '/cachex/',
     ['tests/test_docs.py::test_every_documented_output_is_ignored_by_git']),
    ('.gitignore', 'predictions.csv\n', '',
     ['tests/test_docs.py::test_every_documented_output_is_ignored_by_git']),
    # README's ladder: every rung keeps the global batch it says (--batch-size x processes x --accumulate).
    ('README.md', 'sbatch docs/slurm/train.sbatch --data-dir photos --batch-size 25', 'sbatch docs/slurm/train.sbatch --data-dir photos --batch-size 50',
     ['tests/test_docs.py::test_readmes_commands_keep_their_global_batch_and_learning_rate']),
    ('docs/slurm/train.sbatch', '#SBATCH --nodes=2', '#SBATCH --nodes=4',
     ['tests/test_docs.py::test_readmes_commands_keep_their_global_batch_and_learning_rate']),
    ('README.md', 'python train_dp.py --data-dir photos --batch-size 200', 'python train_dp.py --data-dir photos --batch-size 50',
     ['tests/test_docs.py::test_readmes_commands_keep_their_global_batch_and_learning_rate']),
    # FSDP2 and accelerate's refusals.
    ('train_fsdp.py', '        model.set_requires_gradient_sync(last)  # type: ignore[operator]', '        model.set_requires_gradient_sync(True)',
     ['tests/test_fsdp.py::test_fsdp_reduces_once_per_step_and_validates_with_rank_0s_buffers']),
    ('train_fsdp.py', '    broadcast_buffers(model)  # validate',
     '    pass  # validate',
     ['tests/test_fsdp.py::test_fsdp_reduces_once_per_step_and_validates_with_rank_0s_buffers']),
    ('src/recipe.py', 'fused = gpu_choices(device) and not (sharded and args.optimizer == "sgd")', 'fused = gpu_choices(device)',
     ['tests/test_fsdp.py::test_fsdp_reduces_once_per_step_and_validates_with_rank_0s_buffers']),
    ('tests/conftest.py', '    for unit in units:\n        fully_shard(unit, mesh=mesh)\n', '',
     ['tests/test_fsdp.py::test_fsdp_reduces_once_per_step_and_validates_with_rank_0s_buffers']),
    ('src/fsdp.py', 'with requiring_grad(params, [i in state["state"] for i in range(len(params))]):',
     'with requiring_grad(params, [True] * len(params)):',
     ['tests/test_fsdp.py::test_freeze_epochs_resume_into_fsdp_across_the_unfreezing']),
    ('train_fsdp.py', 'cache_features=False', 'cache_features=True',
     ['tests/test_fsdp.py::test_freeze_epochs_resume_into_fsdp_across_the_unfreezing']),
    ('src/sharded_checkpoint.py', '"params": [number[name] for name in group["params"]]}',
     '"params": group["params"]}',
     ['tests/test_fsdp.py::test_an_fsdp_last_dcp_resumes_under_train_single']),
    ('src/state.py', 'model, optimizer = WholeModel(self.model), WholeOptimizer(self.model, self.optimizer)',
     'model, optimizer = self.model, self.optimizer',
     ['tests/test_fsdp.py::test_freeze_epochs_resume_into_fsdp_across_the_unfreezing']),
    ('train_fsdp.py', 'load_evaluated(args, info, WholeModel(model))',
     'load_evaluated(args, info, model)',
     ['tests/test_fsdp.py::test_evaluate_loads_best_pth_into_the_shards']),
    ('train_fsdp.py', '        fully_shard(unit, mesh=mesh)\n',
     '        pass\n',
     ['tests/test_fsdp.py::test_train_fsdp_gives_each_unit_and_the_root_a_fully_shard_of_its_own',
      'tests/test_fsdp.py::test_profile_counts_the_all_gathers_and_reduce_scatters']),
    ('src/fsdp.py', ' and id(module) in called', '',
     ['tests/test_fsdp.py::test_the_units_are_the_big_blocks_that_the_model_calls']),
    ('src/fsdp.py', 'counted = tensor.to_local() if isinstance(tensor, DTensor) and not whole else tensor', 'counted = tensor',
     ['tests/test_fsdp.py::test_each_vgg16_rank_holds_half_of_what_a_ddp_rank_holds']),
    ('src/accelerate_checks.py', '        if parse_flag_from_env(variable):', '        if False:',
     ['tests/test_fsdp.py::test_accelerate_refuses_a_sharding_plugin_it_was_asked_for']),
    ('src/accelerate_checks.py', 'if kind != DistributedType.NO and not kind.value.startswith("MULTI_"):', 'if False:',
     ['tests/test_fsdp.py::test_accelerate_trains_only_with_its_ddp']),
    ('train_fsdp.py', '        model.set_requires_gradient_sync(last)  # type: ignore[operator]  # an FSDPModule since fully_shard(model)\n        with torch.autocast(device.type, amp_dtype(args.amp), enabled=args.amp != "no"):', '        model.set_requires_gradient_sync(last)  # type: ignore[operator]  # an FSDPModule since fully_shard(model)\n        with torch.autocast(device.type, amp_dtype(args.amp), enabled=False):',
     ['tests/test_fsdp.py::test_amp_autocasts_as_in_the_other_modes']),
    ('src/fsdp.py', '    if not all(param.is_contiguous() for param in model.parameters()):', '    if False:',
     ['tests/test_fsdp.py::test_channels_last_is_refused_in_one_line']),
    # The GPU review's fixes.
    ('src/checkpoint.py', '                state[key] = torch.empty_like(param).copy_(value)', '                pass',
     ['tests/test_gpu_on_cpu_fused_optimizers.py::test_a_resume_with_another_memory_format_gives_the_optimizer_state_the_weights_layout']),
    ('src/accelerate_checks.py', '    check_gpus(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), "accelerate launch --num_processes {gpus}")', '    pass',
     ['tests/test_gpu_on_cpu_hosts.py::test_accelerate_with_more_processes_than_gpus_is_one_line']),
    ('src/data_parallel.py', '        check_bf16(args.amp, gpu)', '        pass',
     ['tests/test_gpu_on_cpu_data_parallel.py::test_data_parallel_checks_bf16_on_every_gpu']),
    ('checks/gpu_selftest.py', 'SYNC_WINDOW = "3:8"', 'SYNC_WINDOW = "2:7"',
     ['tests/test_gpu_on_cpu_selftest.py::test_make_test_gpus_windows_can_see_what_they_check']),
    # One job per module: FSDP's validation forwards, the shards' bytes that Progress watches.
    ('src/fsdp.py', '    for _ in range(most - len(loader)):', '    for _ in range(0):',
     ['tests/test_fsdp.py::test_every_rank_runs_as_many_validation_forwards']),
    ('train_fsdp.py', '        forwards_to_match(model, inputs, loader)',
     '        pass',
     ['tests/test_fsdp.py::test_fsdp_reduces_once_per_step_and_validates_with_rank_0s_buffers']),
    ('src/progress.py', 'watch_rank_bytes(state.optimizer) if self.show and is_sharded(state.optimizer) else None',
     'None',
     ['tests/test_fsdp.py::test_each_rank_holds_half_of_the_model_at_a_step']),
    ('src/progress.py', 'if self.show and is_sharded(state.optimizer)',
     'if is_sharded(state.optimizer)',
     ['tests/test_fsdp.py::test_only_rank_0_writes_and_prints_and_best_pth_is_the_plain_model']),
    # The diff is the tutorial: a stray line in a script (past the margin, three in train_ddp.py).
    ('train_ddp.py', '    train_sampler: DistributedSampler[int] = DistributedSampler(train_set, num_replicas=world_size, rank=rank,',
     '    train_sampler: DistributedSampler[int] = DistributedSampler(train_set, world_size, rank,',
     ['tests/test_scripts.py::test_the_distributed_sampler_is_written_as_torch_documents_it']),
    ('train_fsdp.py', 'whole = (get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))',
     'whole = (None',
     ['tests/test_scripts.py::test_fsdp_shards_each_unit_and_the_root_and_gathers_best_pth_with_torchs_call']),
    # Hygiene: what the code imports is pinned.
    ('requirements.txt', 'numpy==2.4.6\n', '',
     ['tests/test_repository.py::test_every_imported_package_is_pinned']),
    # The HTML report (src/tools/report.py), in a real browser.
    ('src/tools/report.py', 'autoescape=True', 'autoescape=False',
     ['tests/test_report.py::test_names_from_the_disk_show_as_text_and_predictions_come_most_uncertain_first']),
    ('src/tools/report.py', 'return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")',
     'return path.resolve().as_uri()',
     ['tests/test_report.py::test_the_report_loads_from_disk_alone_and_every_image_decodes']),
    ('src/tools/report.py', 'data.dataset.root_dir, data.val_idx', 'data.dataset.root_dir, data.train_idx',
     ['tests/test_report.py::test_the_confusion_matrix_and_galleries_are_those_of_an_independent_computation']),
    ('src/tools/report.py', 'torch.bincount(labels * 2 + predicted', 'torch.bincount(predicted * 2 + labels',
     ['tests/test_report.py::test_the_confusion_matrix_and_galleries_are_those_of_an_independent_computation']),
    ('src/tools/report.py', 'validation.loss.argsort(descending=True, stable=True)',
     'validation.loss.argsort(descending=False, stable=True)',
     ['tests/test_report.py::test_the_confusion_matrix_and_galleries_are_those_of_an_independent_computation']),
    ('src/tools/report.py', '(validation.p_dog - 0.5).abs().argsort(stable=True)', 'validation.p_dog.argsort(stable=True)',
     ['tests/test_report.py::test_the_confusion_matrix_and_galleries_are_those_of_an_independent_computation']),
    ('src/tools/report.py', 'images.sort(key=lambda image: abs(image["p_dog"] - 0.5))',
     'images.sort(key=lambda image: image["p_dog"])',
     ['tests/test_report.py::test_names_from_the_disk_show_as_text_and_predictions_come_most_uncertain_first']),
    ('src/tools/report.py', '        if digest != info.get(key):', '        if False:',
     ['tests/test_report.py::test_the_report_refuses_other_data_another_file_as_output_and_a_foreign_csv']),
    ('src/tools/report.py', 'return GENERATOR.encode() in file.read(4096)', 'return True',
     ['tests/test_report.py::test_the_report_refuses_other_data_another_file_as_output_and_a_foreign_csv']),
    ('src/tools/report.py', 'for b, members in batches.items() if b != batch', 'for b, members in batches.items() if b == batch',
     ['tests/test_report.py::test_the_five_modes_page_shows_their_curves_and_distances_within_the_tolerance']),
    ('src/tools/report.html.jinja', '{% elif pair.share < tolerance %}', '{% elif pair.share < 1 %}',
     ['tests/test_report.py::test_the_five_modes_page_shows_their_curves_and_distances_within_the_tolerance']),
    ('src/checkpoint.py', '"mode": args.mode',
     '"mode": "single"',
     ['tests/test_report.py::test_the_five_modes_page_shows_their_curves_and_distances_within_the_tolerance']),
    ('src/checkpoint.py', '"processes": dist.get_world_size() if dist.is_initialized() else 1,', '"processes": 1,',
     ['tests/test_report.py::test_the_five_modes_page_shows_their_curves_and_distances_within_the_tolerance']),
    # FSDP's --compile: the units and the pieces between them compiled (src/fsdp.py, compile_units).
    ('train_fsdp.py', '    if args.compile:\n        compile_units(model, units)',
     '    if False:\n        compile_units(model, units)',
     ['tests/test_fsdp.py::test_train_fsdp_compile_runs_every_convolution_compiled', 'gpu:compile']),
    ('tests/conftest.py', '    if compiled:\n        compile_units(model, units)\n', '',
     ['tests/test_fsdp.py::test_compile_runs_every_convolution_and_linear_compiled_under_fsdp_as_under_ddp']),
    ('src/fsdp.py', '        if id(module) in holding and type(module).forward is nn.Sequential.forward:',
     '        if False:',
     ['tests/test_fsdp.py::test_compile_runs_every_convolution_and_linear_compiled_under_fsdp_as_under_ddp']),
    ('src/fsdp.py', 'torch.compile(_own_code(_calling(module.forward), name))',
     'torch.compile(_calling(module.forward))',
     ['tests/test_fsdp.py::test_compile_runs_every_convolution_and_linear_compiled_under_fsdp_as_under_ddp']),
    ('src/fsdp.py', 'torch.compile(_own_code(_chain(step), f"{name}.{index}"))', 'torch.compile(_chain(step))',
     ['tests/test_fsdp.py::test_compile_runs_every_convolution_and_linear_compiled_under_fsdp_as_under_ddp']),
    # make test-gpu's checks, each with a breakage it catches on a GPU (gpu:KEY), and its own logic on the CPU.
    ('src/recipe.py', 'fused = gpu_choices(device) and not (sharded and args.optimizer == "sgd")',
     'fused = gpu_choices(device) and args.optimizer == "adamw"',
     ['tests/test_gpu_on_cpu_selftest.py::test_make_test_gpus_fused_optimizer_check_bites', 'gpu:gpu']),
    ('train_accelerate.py', '    configure_numerics(args.deterministic)  # after Accelerator()', '    pass  # ', ['gpu:gpu']),
    ('train_fsdp.py', 'scaler.scale(loss / args.accumulate)', 'scaler.scale(loss)', ['gpu:agreement']),
    ('train_single.py', 'enabled=args.amp != "no"):\n            logits = model(inputs)\n            loss',
     'enabled=args.amp == "bf16"):\n            logits = model(inputs)\n            loss', ['gpu:fp16']),
    ('src/transforms.py', '    batch = batch.to(device, non_blocking=True)', '    batch = batch.to(device)', ['gpu:sync']),
    ('src/checkpoint.py', '            load_optimizer(optimizer, state["optimizer"])',
     '            pass',
     ['tests/test_reliability.py::test_ctrl_c_anywhere_then_resume_equals_the_straight_run', 'gpu:resume']),
    ('checks/gpu_selftest.py', '                groups.add(os.getpgid(pid))', '                groups.add(launch.pid)',
     ['tests/test_gpu_selftest_logic.py::test_stop_ends_the_workers_that_torchrun_puts_in_sessions_of_their_own']),
    ('checks/gpu_selftest.py', '        flags += ["--dist-timeout", str(run.dist_timeout(cpu))]', '        pass',
     ['tests/test_gpu_selftest_logic.py::test_every_distributed_launch_times_out_its_collectives_well_before_its_limit']),
    ('checks/gpu_selftest.py', 'DIST_TIMEOUT, COMPILED_DIST_TIMEOUT, CPU_DIST_TIMEOUT, TEARDOWN = 1, 3, 10, 90',
     'DIST_TIMEOUT, COMPILED_DIST_TIMEOUT, CPU_DIST_TIMEOUT, TEARDOWN = 5, 5, 10, 0',
     ['tests/test_gpu_selftest_logic.py::test_every_distributed_launch_times_out_its_collectives_well_before_its_limit']),
    ('checks/gpu_selftest.py', '        except RuntimeError as error:\n            result.add(str(error), failed=name)',
     '        except RuntimeError:\n            raise',
     ['tests/test_gpu_selftest_logic.py::test_agreement_runs_every_leg_after_one_failed_and_names_the_failed_mode']),
    ('checks/gpu_selftest.py', ' and dtypes == {"float16"}', '',
     ['tests/test_gpu_selftest_logic.py::test_fp16_needs_float16_logits_on_every_rank']),
    ('checks/gpu_selftest.py', 'ok &= windows == 2 and controls == windows and not other', 'ok &= not other',
     ['tests/test_gpu_selftest_logic.py::test_the_sync_verdict_needs_the_control_and_nothing_but_what_is_allowed']),
    ('checks/gpu_selftest.py', 'allowed = {SCALER_READ} if name == "sgd-fp16-fsdp-shared" else set()',
     'allowed = {SCALER_READ}',
     ['tests/test_gpu_selftest_logic.py::test_only_the_fsdp_sgd_run_may_read_the_scalers_flag']),
    ('checks/gpu_selftest.py', 'ok &= record["forwards"] > 0 and all(record[kind] == expected[kind] for kind in expected)',
     'ok &= record["forwards"] > 0',
     ['tests/test_gpu_selftest_logic.py::test_the_compiled_verdict_needs_every_convolution_of_every_forward']),
    ('checks/gpu_selftest.py', 'ok = seen.get("accelerator") is True and seen.get("step") is False',
     'ok = seen.get("step") is False',
     ['tests/test_gpu_selftest_logic.py::test_the_tf32_verdict_needs_accelerate_to_have_turned_it_on_and_the_script_off']),
    ('checks/gpu_selftest.py', '"verdict": "FAILED" if result.failed else "passed"', '"verdict": "passed"',
     ['tests/test_gpu_selftest_logic.py::test_a_check_that_raises_fails_under_its_name_and_the_others_still_run']),
    ('checks/gpu_selftest.py', 'assert off <= 1e-5 and all(kernels.values()) and steps == [2.0], lines',
     'assert off <= 1e-5 and kernels["adamw"] and steps == [2.0], lines',
     ['tests/test_gpu_selftest_logic.py::test_the_fused_optimizer_check_fails_when_sgd_is_not_fused']),
    ('tests/hooks/sitecustomize.py', '        if any(frame.name == "_control_sync" for frame in stack):', '        if False:',
     ['tests/test_gpu_selftest_logic.py::test_the_sync_record_sorts_the_control_from_the_others']),
    ('tests/hooks/sitecustomize.py', '                counts[kind] += number', '                pass',
     ['tests/test_gpu_selftest_logic.py::test_the_counting_backend_counts_the_calls_inside_compiled_graphs']),
    ('tests/hooks/sitecustomize.py', '            seen.add(input.dtype)\n', '',
     ['tests/test_gpu_selftest_logic.py::test_the_dtype_hook_logs_each_dtype_of_the_logits_once']),
    # The same model in every mode: dropout per sample, --sync-bn, --ema-decay.
    ("src/models.py", "return per_sample(model)  # dropout masks drawn per sample: the same in every mode", "return model",
     ["tests/test_modes.py::test_two_processes_match_single_and_only_rank_0_writes_prints_and_scans",
      "tests/test_dropout.py::test_built_models_draw_per_sample_and_keep_torchvision_state_dicts"]),
    ('src/augment.py', 'return image, target, sample_key(self.seed, epoch, index)',
     'return image, target, sample_key(self.seed, 0, index)',
     ['tests/test_dropout.py::test_the_loader_hands_each_sample_its_key_for_its_epoch']),
    ("src/dropout.py", "    h = per_sample[:, None] ^ elements[None, :]",
     "    h = per_sample[:, None] + 0 * elements[None, :]",
     ["tests/test_dropout.py::test_a_mask_is_the_hand_computed_function_of_key_unit_and_element",
      "tests/test_dropout.py::test_masks_vary_across_samples_units_and_epochs_in_the_proportion_p"]),
    ("src/dropout.py", "out = _Scale.apply(x, kept, 1 / (1 - self.p) if self.p < 1 else 0.0)", "out = _Scale.apply(x, kept, 1.0)",
     ["tests/test_dropout.py::test_the_expectation_is_kept_and_evaluation_is_untouched"]),
    ("src/data_parallel.py", "                set_samples(replica, share.to(", "                (replica, share.to(",
     ["tests/test_gpu_on_cpu_data_parallel.py::test_each_replica_draws_the_masks_of_its_own_samples"]),
    ("src/batch_norm.py", "            module.__class__ = SyncedBatchNorm", "            pass",
     ["tests/test_sync_bn.py::test_two_ranks_normalise_as_one_batch_norm_of_the_whole_batch",
      "tests/test_sync_bn.py::test_resnet18_with_sync_bn_ends_where_one_process_ends"]),
    ("src/batch_norm.py", "            dist.all_reduce(sums)\n", "",
     ["tests/test_sync_bn.py::test_two_ranks_normalise_as_one_batch_norm_of_the_whole_batch"]),
    ("train_ddp.py", "model = sync_batch_norm(model, device) if args.sync_bn else model", "model = model",
     ["tests/test_sync_bn.py::test_resnet18_with_sync_bn_ends_where_one_process_ends"]),
    ("train_fsdp.py", "model = sync_batch_norm(model, device) if args.sync_bn else model", "model = model",
     ["tests/test_sync_bn.py::test_resnet18_with_sync_bn_ends_where_one_process_ends"]),
    ("train_accelerate.py", "model = sync_batch_norm(model, device) if args.sync_bn else model", "model = model",
     ["tests/test_sync_bn.py::test_resnet18_with_sync_bn_ends_where_one_process_ends"]),
    ("src/data_parallel.py", "    if args.sync_bn:  # nn.SyncBatchNorm synchronises processes", "    if False:  #",
     ["tests/test_sync_bn.py::test_data_parallel_refuses_sync_bn"]),
    ("src/ema.py", '            optimizer.register_step_post_hook(lambda stepped, *_: self.update(getattr(stepped, "found_inf", None)))', "            pass",
     ["tests/test_ema.py::test_the_average_is_the_hand_computed_recursion_of_the_steps",
      "tests/test_ema.py::test_the_average_is_updated_once_per_optimizer_step_with_accumulate"]),
    ("src/ema.py", 'optimizer.register_step_post_hook(lambda stepped, *_: self.update(getattr(stepped, "found_inf", None)))',
     'model.register_forward_hook(lambda *_: self.update())',
     ["tests/test_ema.py::test_the_average_is_updated_once_per_optimizer_step_with_accumulate"]),
    ("src/ema.py", 'self.update(getattr(stepped, "found_inf", None))', 'self.update()',
     ["tests/test_gpu_on_cpu_fused_optimizers.py::test_the_weight_average_leaves_out_the_steps_the_scaler_skips_under_fused_sgd"]),
    ("src/ema.py", "            weight = (1 - decay_at(t, self.decay)) * (1 - skip)",
     "            weight = (1 - decay_at(t, self.decay))",
     ["tests/test_ema.py::test_a_step_the_fp16_scaler_skips_inside_a_fused_kernel_changes_nothing"]),
    ("src/ema.py", "            self.skipped += skip\n", "",
     ["tests/test_gpu_on_cpu_fused_optimizers.py::test_the_weight_average_leaves_out_the_steps_the_scaler_skips_under_fused_sgd"]),
    ("src/ema.py", "                module.reshard()", "                pass",
     ["tests/test_fsdp.py::test_fsdp_with_the_full_recipe_and_accumulate_matches_single"]),
    ('src/checkpoint.py', 'chosen = average_state["model"] if weights == "average" and average_state is not None else model_state',
     'chosen = model_state',
     ['tests/test_ema.py::test_best_pth_holds_the_average_when_it_validates_better']),
    ('src/checkpoint.py', '                average.load(getattr(model, "_orig_mod", model), state["average"])',
     '                pass',
     ['tests/test_reliability.py::test_ctrl_c_anywhere_then_resume_equals_the_straight_run']),
    ("src/history.py", '    offered = [(record, "weights")]\n    if AVERAGE["val_acc"] in record:', '    offered = [(record, "weights")]\n    if False:',
     ["tests/test_ema.py::test_best_pth_holds_the_average_when_it_validates_better"]),
    ('src/data_parallel.py', '        if keys is not None and module.training:', '        if keys is not None:',
     ['tests/test_gpu_on_cpu_data_parallel.py::test_each_replica_draws_the_masks_of_its_own_samples']),
    ('src/tools/benchmark.py', '            layer.__class__ = layer.__class__.__mro__[1]', '            pass',
     ['tests/test_benchmark.py::test_the_torch_dropout_step_draws_from_the_generator_and_the_runs_step_does_not']),
    # Hostile and careless input: outputs, the folder lock, --overwrite, divergence, CSV and terminal.
    ('src/outputs.py', '    if kind is not None:\n        why =', '    if False:\n        why =',
     ['tests/test_outputs.py::test_training_refuses_a_target_that_is_not_a_regular_file', 'tests/test_outputs.py::test_predict_refuses_a_special_output_and_writes_to_standard_output_with_a_dash', 'tests/test_outputs.py::test_prepare_refuses_a_train_csv_that_is_not_a_regular_file']),
    ('src/outputs.py', '    if os.path.lexists(path) and not os.path.isdir(path):', '    if False:',
     ['tests/test_outputs.py::test_training_refuses_a_target_that_is_not_a_regular_file']),
    ('src/outputs.py', '            if real == other_real or (inode is not None and inode == other_inode):', '            if False:',
     ['tests/test_outputs.py::test_training_refuses_an_output_that_is_an_input_or_another_output']),
    ('src/outputs.py', '        if read is not None:', '        if False:',
     ['tests/test_outputs.py::test_training_refuses_an_output_that_is_an_input_or_another_output', 'tests/test_outputs.py::test_predict_and_export_refuse_to_write_over_what_they_read']),
    ('src/outputs.py', '            if what != flag and _inside(os.path.realpath(path), os.path.realpath(folder)):', '            if False:',
     ['tests/test_outputs.py::test_training_refuses_an_output_that_is_an_input_or_another_output']),
    ('src/outputs.py', '        read = by_path.get(real) or (by_inode.get(inode) if inode is not None else None)', '        read = by_path.get(real)',
     ['tests/test_outputs.py::test_training_refuses_an_output_that_is_an_input_or_another_output']),
    ('src/outputs.py', '    check_outputs([(OUTPUT_FLAGS[name], path)', '    (lambda *args, **kwargs: None)([(OUTPUT_FLAGS[name], path)',
     ['tests/test_outputs.py::test_training_refuses_a_target_that_is_not_a_regular_file', 'tests/test_outputs.py::test_training_refuses_an_output_that_is_an_input_or_another_output']),
    ('src/outputs.py', '    lock = hold(paths["best"].parent)  # before',
     '    lock = RunLock(None)  # before',
     ['tests/test_outputs.py::test_a_second_run_in_a_folder_stops_naming_the_first']),
    ('src/outputs.py', '        _check_overwrite(args, paths)\n', '        pass\n',
     ['tests/test_outputs.py::test_a_new_run_does_not_replace_an_earlier_runs_files_unless_told']),
    ('src/outputs.py', '    if restarted():\n        return\n    shards',
     '    if False:\n        return\n    shards',
     ['tests/test_outputs.py::test_a_new_run_does_not_replace_an_earlier_runs_files_unless_told']),
    ('src/checkpoint.py', '        _check_history(state)\n', '',
     ['tests/test_diverged.py::test_resume_refuses_a_last_pth_whose_history_or_info_is_not_ours']),
    ('src/checkpoint.py', '        if not isinstance(saved, dict):', '        if False:',
     ['tests/test_diverged.py::test_resume_refuses_a_last_pth_whose_history_or_info_is_not_ours']),
    ('src/checkpoint.py', '            check_finite_weights(state["model"], state["from"], advice)\n', '',
     ['tests/test_diverged.py::test_resume_refuses_a_last_pth_that_diverged']),
    ('src/outputs.py', '        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)', '        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)',
     ['tests/test_outputs.py::test_the_lock_goes_with_the_process_however_it_ends']),
    ('src/outputs.py', '        os.pwrite(fd, who.encode("utf-8", "surrogateescape") + b"\\n", 0)', '        pass',
     ['tests/test_outputs.py::test_a_second_run_in_a_folder_stops_naming_the_first']),
    ('src/cli.py', '    if not math.isfinite(value):', '    if False:',
     ['tests/test_diverged.py::test_every_float_flag_refuses_values_that_are_not_finite']),
    ('src/cli.py', '        if value > maximum:', '        if False:',
     ['tests/test_inputs.py::test_an_image_size_above_the_range_is_refused_as_a_flag']),
    ('src/cli.py', 'cap_workers(workers, available_cpus()))', 'workers)',
     ['tests/test_inputs.py::test_workers_above_the_cpus_are_capped_in_one_line']),
    ('src/cli.py', '    if args.resume and args.overwrite:', '    if False:',
     ['tests/test_outputs.py::test_a_new_run_does_not_replace_an_earlier_runs_files_unless_told']),
    ('src/history.py', '    check_finite_loss(train_sums, f"epoch {epoch + 1}", "training")\n', '',
     ['tests/test_diverged.py::test_a_diverged_epoch_stops_the_run_and_saves_nothing_of_it']),
    ('src/history.py', '    check_finite_loss(val_sums, f"epoch {epoch + 1}", "validation")\n', '',
     ['tests/test_diverged.py::test_a_diverged_epoch_stops_the_run_and_saves_nothing_of_it']),
    ('src/divergence.py', '    if not math.isfinite(loss):', '    if False:',
     ['tests/test_diverged.py::test_a_diverged_epoch_stops_the_run_and_saves_nothing_of_it']),
    ('src/divergence.py', '{ADVICE}", quiet=not is_first())', '{ADVICE}")',
     ['tests/test_diverged.py::test_under_torchrun_every_rank_stops_on_one_ranks_nan']),
    ('src/divergence.py', '    if bad:\n        raise UserError(f"{path} holds weights', '    if False:\n        raise UserError(f"{path} holds weights',
     ['tests/test_diverged.py::test_predict_export_and_resume_refuse_weights_that_are_not_finite', 'tests/test_diverged.py::test_resume_refuses_a_last_pth_that_diverged']),
    ('src/inference.py', '        check_finite_weights(state, checkpoint, f"retrain ({ADVICE})")', '        pass',
     ['tests/test_diverged.py::test_predict_export_and_resume_refuse_weights_that_are_not_finite']),
    ('src/inference.py', '    check_info(info, info_path)\n', '',
     ['tests/test_inputs.py::test_a_hand_edited_best_json_is_refused_field_by_field_at_start', 'tests/test_inputs.py::test_a_best_json_that_is_not_an_object']),
    ('src/inference.py', '    if not isinstance(arch, str) or arch not in classification_models():', '    if not isinstance(arch, str):',
     ['tests/test_inputs.py::test_a_hand_edited_best_json_is_refused_field_by_field_at_start']),
    ('src/inference.py', '    if info.get("classes") != list(CLASSES):', '    if False:',
     ['tests/test_inputs.py::test_a_hand_edited_best_json_is_refused_field_by_field_at_start']),
    ('src/inference.py', '        if not isinstance(value, list) or len(value) != 3 or not all(_number(v) for v in value):', '        if False:',
     ['tests/test_inputs.py::test_a_hand_edited_best_json_is_refused_field_by_field_at_start']),
    ('src/inference.py', '    if not all(v > 0 for v in info["std"]):', '    if False:',
     ['tests/test_inputs.py::test_a_hand_edited_best_json_is_refused_field_by_field_at_start']),
    ('src/inference.py', 'or not low <= size <= high:', 'or not low <= size:',
     ['tests/test_inputs.py::test_a_huge_image_size_is_refused_before_it_fills_the_memory']),
    ('src/tools/predict.py', '    check_room(args.output, 100 + sum(', '    (lambda *args: None)(args.output, 100 + sum(',
     ['tests/test_outputs.py::test_predict_onto_a_full_disk_stops_before_the_pass']),
    ('src/tools/predict.py', '    check_finite(result)\n', '',
     ['tests/test_diverged.py::test_predict_refuses_probabilities_that_are_not_finite']),
    ('src/tools/predict.py', '    if not to_stdout(args):\n        atomic_write_text(args.output, text)', '    if True:\n        atomic_write_text(args.output, text)',
     ['tests/test_outputs.py::test_predict_refuses_a_special_output_and_writes_to_standard_output_with_a_dash']),
    ('src/tools/predict.py', '    inputs = [("an image to predict", file) for file in files]', '    inputs = []',
     ['tests/test_outputs.py::test_predict_and_export_refuse_to_write_over_what_they_read']),
    ('src/tools/predict.py', '        args.workers = cap_workers(args.workers, len(os.sched_getaffinity(0)))', '        pass',
     ['tests/test_inputs.py::test_workers_above_the_cpus_are_capped_in_one_line']),
    ('src/tools/predict.py', 'lines = [f"left out {shown(files[i])}', 'lines = [f"left out {files[i]}',
     ['tests/test_inputs.py::test_names_reach_the_terminal_escaped']),
    ('src/tools/predict.py', 'done = [(shown(file), p)', 'done = [(str(file), p)',
     ['tests/test_inputs.py::test_names_reach_the_terminal_escaped']),
    ('src/safe_csv.py', '    return "\'" + cell if cell.startswith(FORMULA_STARTS + ("\'",)) else cell', '    return cell',
     ['tests/test_inputs.py::test_predict_csv_reads_back_row_for_row_and_opens_safely_in_a_spreadsheet']),
    ('src/safe_csv.py', 'FORMULA_STARTS + ("\'",)', 'FORMULA_STARTS',
     ['tests/test_inputs.py::test_predict_csv_reads_back_row_for_row_and_opens_safely_in_a_spreadsheet']),
    ('src/safe_csv.py', '    if any(char in cell for char in \',"\\r\\n\'):', '    if any(char in cell for char in \',"\\n\'):',
     ['tests/test_inputs.py::test_predict_csv_reads_back_row_for_row_and_opens_safely_in_a_spreadsheet', 'tests/test_inputs.py::test_training_and_prepare_take_names_that_are_not_utf8_or_hold_line_breaks']),
    ('src/terminal.py', '    if text.isprintable():', '    if True:',
     ['tests/test_inputs.py::test_names_reach_the_terminal_escaped']),
    ('src/errors.py', '        return shown(text.strip())\n    lines', '        return text.strip()\n    lines',
     ['tests/test_inputs.py::test_names_reach_the_terminal_escaped']),
    ('src/datasets.py', '        if archive.is_file():', '        if False:',
     ['tests/test_inputs.py::test_a_zipped_train_folder_and_a_folder_of_one_class']),
    ('src/datasets.py', '                            encoding_errors="surrogateescape")', '                            encoding_errors="strict")',
     ['tests/test_inputs.py::test_training_and_prepare_take_names_that_are_not_utf8_or_hold_line_breaks']),
    ('src/image_files.py', '                found.append(f"{relative}{entry.name}")',
     '                found.append(f"{relative}{entry.name}") if entry.is_file() else None',
     ['tests/test_inputs.py::test_names_reach_the_terminal_escaped',
      'tests/test_inputs.py::test_links_to_nothing_in_train_are_counted_and_named',
      'tests/test_inputs.py::test_a_named_pipe_is_named_for_what_it_is_and_never_opened']),
    ('src/image_files.py', '        if isinstance(error, OSError) and broken_link(Path(path)):', '        if False:',
     ['tests/test_inputs.py::test_names_reach_the_terminal_escaped']),
    ('src/loaders.py', '            check_both_classes(table, data_dir)', '            pass',
     ['tests/test_inputs.py::test_a_zipped_train_folder_and_a_folder_of_one_class']),
    ('src/loaders.py', '.encode("utf-8", "surrogateescape")).hexdigest()', '.encode()).hexdigest()',
     ['tests/test_inputs.py::test_training_and_prepare_take_names_that_are_not_utf8_or_hold_line_breaks']),
    ('src/tools/export.py', '        shutil.rmtree(stale, ignore_errors=True)', '        pass',
     ['tests/test_outputs.py::test_export_removes_a_killed_exports_folder_and_says_a_full_disk']),
    ('src/tools/export.py', '    except OSError as error:  # a full disk: the old file stays\n        raise UserError(cannot_write(output, error)) from None\n', '',
     ['tests/test_outputs.py::test_export_removes_a_killed_exports_folder_and_says_a_full_disk']),
    ('src/tools/export.py', '"an ONNX file of src.tools.export", overwrite, inputs=inputs)', '"an ONNX file of src.tools.export", overwrite)',
     ['tests/test_outputs.py::test_predict_and_export_refuse_to_write_over_what_they_read']),
    ('src/tools/prepare.py', '    check_outputs([("DATA_DIR\'s train.csv", data_dir / "train.csv")])\n', '',
     ['tests/test_outputs.py::test_prepare_refuses_a_train_csv_that_is_not_a_regular_file']),
    ('src/tools/prepare.py', 'csv_text(["filename", "label"], frame.itertuples(index=False))', 'frame.to_csv(index=False)',
     ['tests/test_inputs.py::test_training_and_prepare_take_names_that_are_not_utf8_or_hold_line_breaks']),
    ('src/outputs.py', '        if found:\n', '        if False:\n',
     ['tests/test_outputs.py::test_synthetic_writes_only_where_it_may']),
    ('src/outputs.py', '    if os.path.lexists(folder) and not folder.is_dir():', '    if False:',
     ['tests/test_outputs.py::test_synthetic_writes_only_where_it_may']),
    ('src/tools/synthetic.py', '        for name in WRITES:  # our own files of an earlier run, and the train.csv prepare made of them\n', '        for name in ():\n',
     ['tests/test_outputs.py::test_synthetic_writes_only_where_it_may']),
    ('src/tools/synthetic.py', '    except OSError as error:  # a full disk, a quota\n', '    except ZeroDivisionError as error:  # a full disk, a quota\n',
     ['tests/test_outputs.py::test_synthetic_writes_only_where_it_may']),
    # Fresh breakages that once passed the suite, and their kinds. Two real gloo ranks
    # (tests/test_two_ranks.py): reductions and rank-dependent indices with uneven shares, what
    # each rank prints, a torchrun restart.
    ('src/fsdp.py', '    most = math.ceil(loader.sampler.largest / loader.batch_size)',
     '    most = math.ceil(len(loader.dataset) / loader.batch_size)',
     ['tests/test_two_ranks.py::test_fsdp_validation_forwards_and_sums_with_uneven_shards',
      'tests/test_fsdp.py::test_every_rank_runs_as_many_validation_forwards']),
    ('src/fsdp.py', '    for _ in range(most - len(loader)):', '    for _ in range(most - len(loader.sampler)):',
     ['tests/test_two_ranks.py::test_fsdp_validation_forwards_and_sums_with_uneven_shards']),
    ('src/process_group.py', 'return dist.PrefixStore(f"attempt{attempt}", store), rank, world_size',
     'return dist.PrefixStore("attempt0", store), rank, world_size',
     ['tests/test_two_ranks.py::test_a_restarted_attempt_joins_a_store_holding_the_dead_attempts_keys',
      'tests/test_reliability.py::test_killed_worker_is_restarted_and_the_job_finishes_the_same']),
    ('src/checkpoint.py', 'source = -max(held)[1]', 'source = -min(held)[1]',
     ['tests/test_two_ranks.py::test_every_rank_resumes_from_the_newest_last_pth_of_any_node']),
    ('src/checkpoint.py', 'held = [(epoch[:2], -rank, epoch[2]) for rank, epoch in enumerate(places) if epoch is not None]',
     'held = [(epoch[:2], rank, epoch[2]) for rank, epoch in enumerate(places) if epoch is not None]',
     ['tests/test_two_ranks.py::test_every_rank_resumes_from_the_newest_last_pth_of_any_node']),
    ('src/inference.py', '    share[[i - sampler.start for i in broken]] = float("nan")',
     '    share[[i for i in broken]] = float("nan")',
     ['tests/test_two_ranks.py::test_a_broken_image_on_rank_1_leaves_its_own_row_out']),
    ('train_fsdp.py', 'scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")',
     'scaler = torch.amp.GradScaler(device.type, enabled=False)',
     ['tests/test_two_ranks.py::test_fsdp_fp16_scales_the_loss_on_both_ranks']),
    ('train_fsdp.py', '    if rank == 0:\n        print(run_header(', '    if True:\n        print(run_header(',
     ['tests/test_two_ranks.py::test_rank_0_alone_speaks_and_says_each_thing_once']),
    ('train_fsdp.py', '    if rank == 0:\n        print(done_line(', '    if True:\n        print(done_line(',
     ['tests/test_two_ranks.py::test_rank_0_alone_speaks_and_says_each_thing_once']),
    ('train_ddp.py', '    if rank == 0:\n        print(done_line(', '    if True:\n        print(done_line(',
     ['tests/test_two_ranks.py::test_rank_0_alone_speaks_and_says_each_thing_once']),
    ('train_accelerate.py', '    if accelerator.is_main_process:\n        print(done_line(',
     '    if True:\n        print(done_line(', ['tests/test_two_ranks.py::test_rank_0_alone_speaks_and_says_each_thing_once']),
    ('src/checkpoint.py', 'path, announce = output_paths(args)["last"], is_first()',
     'path, announce = output_paths(args)["last"], True',
     ['tests/test_two_ranks.py::test_rank_0_alone_speaks_and_says_each_thing_once']),
    ('src/freeze.py', 'end, show = frozen_until(args), is_first()', 'end, show = frozen_until(args), True',
     ['tests/test_two_ranks.py::test_rank_0_alone_speaks_and_says_each_thing_once']),
    ('src/progress.py', 'self.profiler = Profiler(args, device) if args.profile and self.show else None',
     'self.profiler = Profiler(args, device) if args.profile else None',
     ['tests/test_two_ranks.py::test_rank_0_alone_speaks_and_says_each_thing_once']),
    ('src/inference.py', 'leave=False, disable=rank != 0):', 'leave=False, disable=False):',
     ['tests/test_two_ranks.py::test_rank_0_alone_speaks_and_says_each_thing_once']),
    ('src/cache.py', '        if show_progress:\n            print(f"reading', '        if True:\n            print(f"reading',
     ['tests/test_two_ranks.py::test_rank_0_alone_speaks_and_says_each_thing_once']),
    ('src/checkpoint.py', 'if state["epoch"] > args.epochs:', 'if state["epoch"] >= args.epochs:',
     ['tests/test_resume_rules.py::test_a_run_resumes_up_to_and_beyond_the_epochs_it_finished',
      'tests/test_two_ranks.py::test_rank_0_alone_speaks_and_says_each_thing_once']),
    ('src/outputs.py', '        os.fchmod(fd, 0o666 & ~_UMASK)', '        pass',
     ['tests/test_two_ranks.py::test_rank_0_alone_writes_each_file_in_its_order_with_the_usual_mode']),
    ('src/outputs.py', 'os.O_CLOEXEC, 0o666)', 'os.O_CLOEXEC, 0o600)',
     ['tests/test_two_ranks.py::test_rank_0_alone_writes_each_file_in_its_order_with_the_usual_mode']),
    # Such breakages that one process shows, and their kinds.
    ('train_fsdp.py', 'model.train(not frozen)', 'model.train(True)',
     ['tests/test_one_step.py::test_a_frozen_stage_trains_the_head_alone_with_the_backbone_in_eval_mode']),
    ('src/inference.py', '("arch", "num_classes", "image_size", "seed", "val_fraction", "data", "val_data")',
     '("arch", "num_classes", "image_size", "seed", "data", "val_data")',
     ['tests/test_evaluate.py::test_evaluate_refuses_a_checkpoint_of_other_flags']),
    ('src/inference.py', '("arch", "num_classes", "image_size", "seed", "val_fraction", "data", "val_data")',
     '("arch", "num_classes", "image_size", "seed", "val_fraction", "val_data")',
     ['tests/test_evaluate.py::test_evaluate_refuses_a_checkpoint_of_other_images']),
    ('src/tools/export.py', 'key=lambda name: name == output.name)', 'key=lambda name: name != output.name)',
     ['tests/test_export.py::test_the_onnx_file_comes_after_its_weights_with_the_usual_mode']),
    ('src/tools/export.py', '        os.chmod(folder / name, 0o666 & ~umask)', '        pass',
     ['tests/test_export.py::test_the_onnx_file_comes_after_its_weights_with_the_usual_mode']),
    ('src/tools/export.py', '        os.chmod(folder / name, 0o666 & ~umask)', '        os.chmod(folder / name, 0o644)',
     ['tests/test_export.py::test_the_onnx_file_comes_after_its_weights_with_the_usual_mode']),
    ('src/tools/onnx_model.py', 'if (images.type != "tensor(uint8)" or list(images.shape[1:]) != [3, size, size]',
     'if (images.type != "tensor(uint8)"',
     ['tests/test_export.py::test_an_onnx_file_whose_graph_is_not_its_metadata_is_refused']),
    ('src/tools/onnx_model.py', '            or probabilities.shape[1:] != [len(classes)]):', '            ):',
     ['tests/test_export.py::test_an_onnx_file_whose_graph_is_not_its_metadata_is_refused']),
    ('src/tools/rounding.py', 'bound = 4 * LAMBDA * U', 'bound = 2 * LAMBDA * U',
     ['tests/test_export.py::test_the_rounding_bound_is_the_hand_computed_formula']),
    ('src/tools/rounding.py', 'p64 * (1 - p64) + 4 * U', 'p64 * (1 - p64) + 2 * U',
     ['tests/test_export.py::test_the_rounding_bound_is_the_hand_computed_formula']),
    ('src/tools/rounding.py', 'total += math.sqrt(module.embed_dim) + math.sqrt(module.head_dim)',
     'total += math.sqrt(module.embed_dim)',
     ['tests/test_export.py::test_the_rounding_bound_is_the_hand_computed_formula']),
    ('src/image_files.py', '                seen.add(os.path.realpath(file))', '                seen.add(file)',
     ['tests/test_predict.py::test_a_file_named_twice_is_listed_once']),
    ('src/image_files.py', '                seen.add(os.path.realpath(file))', '                seen.add(os.path.abspath(file))',
     ['tests/test_predict.py::test_a_file_named_twice_is_listed_once']),
    ('src/image_files.py', '            elif os.path.realpath(file) not in seen:', '            elif os.path.abspath(file) not in seen:',
     ['tests/test_predict.py::test_a_file_named_twice_is_listed_once']),
    ('src/progress.py', 'epoch * self.state.steps_per_epoch + index // self.args.accumulate',
     'epoch * self.state.steps_per_epoch + index',
     ['tests/test_watch.py::test_tensorboard_counts_optimizer_steps_under_accumulate']),
    ('src/devices.py', '    return max(1, available_cpus() // local_processes)', '    return max(1, available_cpus())',
     ['tests/test_gpu_on_cpu_hosts.py::test_each_process_of_a_node_takes_its_share_of_the_cpus_as_workers']),
    ('src/devices.py', '    return max(1, available_cpus() // local_processes)', '    return available_cpus() // local_processes',
     ['tests/test_gpu_on_cpu_hosts.py::test_each_process_of_a_node_takes_its_share_of_the_cpus_as_workers']),
    ('src/cli.py', '    if workers <= cpus:', '    if workers < cpus:',
     ['tests/test_gpu_on_cpu_hosts.py::test_the_workers_cap_is_said_by_rank_0_alone']),
    ('src/cli.py', '    if os.environ.get("RANK", "0") == "0":', '    if True:',
     ['tests/test_gpu_on_cpu_hosts.py::test_the_workers_cap_is_said_by_rank_0_alone']),
    ('src/data_parallel.py', 'enabled=torch.is_autocast_enabled(self.device_type)', 'enabled=True',
     ['tests/test_gpu_on_cpu_data_parallel.py::test_data_parallel_replicas_without_amp_run_in_float32']),
    ('src/checkpoint.py', 'for key in RESUME_KEYS + (("epochs",) if args.lr_schedule != "constant" else ()):',
     'for key in RESUME_KEYS:', ['tests/test_resume_rules.py::test_a_schedule_that_spans_the_run_keeps_its_epochs']),
    ('src/ranks.py', 'return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0',
     'return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) >= 0',
     ['tests/test_resume_rules.py::test_a_restarted_worker_resumes_without_being_asked']),
    # Random draws in the proportions documented (tests/test_random_draws.py).
    ('src/augment.py', 'flip = bool(torch.rand(1, generator=generator).item() < 0.5)',
     'flip = bool(torch.rand(1, generator=generator).item() < 0.4)',
     ['tests/test_random_draws.py::test_augmentation_crops_and_flips_in_the_documented_proportions']),
    ('src/augment.py', 'SCALE = (0.25, 1.0)', 'SCALE = (0.3, 1.0)',
     ['tests/test_random_draws.py::test_augmentation_crops_and_flips_in_the_documented_proportions']),
    ('src/augment.py', 'RATIO = (3 / 4, 4 / 3)', 'RATIO = (3 / 4, 5 / 4)',
     ['tests/test_random_draws.py::test_augmentation_crops_and_flips_in_the_documented_proportions']),
    ('src/augment.py', '            top = min(int(y * (size - height + 1)), size - height)',
     '            top = min(int(y * (size - height)), size - height)',
     ['tests/test_random_draws.py::test_augmentation_crops_and_flips_in_the_documented_proportions']),
    ('src/augment.py', 'manual_seed(derive_seed(seed, epoch, index))', 'manual_seed(derive_seed(seed, 0, index))',
     ['tests/test_random_draws.py::test_augmentation_draws_anew_each_epoch_and_for_each_seed']),
    ('src/loaders.py', 'perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()',
     'perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()',
     ['tests/test_random_draws.py::test_the_validation_split_holds_each_image_in_the_stated_share_across_seeds']),
    ('train_ddp.py', "    dist.all_reduce(sums)  # every rank's samples", '    pass',
     ['tests/test_two_ranks.py::test_each_epoch_counts_the_samples_of_both_ranks']),
    ('train_fsdp.py', "    dist.all_reduce(sums)  # every rank's samples", '    pass',
     ['tests/test_two_ranks.py::test_each_epoch_counts_the_samples_of_both_ranks']),
    ('train_fsdp.py', "    dist.all_reduce(sums)  # every rank's sums: each validation sample is in exactly one shard", '    pass',
     ['tests/test_two_ranks.py::test_each_epoch_counts_the_samples_of_both_ranks',
      'tests/test_two_ranks.py::test_fsdp_validation_forwards_and_sums_with_uneven_shards']),
    ('train_accelerate.py', 'sums = accelerator.reduce(sums, reduction="sum")', 'sums = sums',
     ['tests/test_two_ranks.py::test_each_epoch_counts_the_samples_of_both_ranks']),
    ('train_accelerate.py', 'batch_sums(*accelerator.gather_for_metrics((logits, labels)))', 'batch_sums(logits, labels)',
     ['tests/test_two_ranks.py::test_each_epoch_counts_the_samples_of_both_ranks']),
    # Stop at any step and lose nothing: step checkpoints, stops on signals, the hung-rank line.
    ('src/loaders.py', '            if i >= self.skip:',
     '            if True:',
     ['tests/test_loaders.py::test_a_resumed_epoch_skips_its_finished_steps_without_reading_their_images', 'tests/test_reliability.py::test_ctrl_c_anywhere_then_resume_equals_the_straight_run']),
    ('train_accelerate.py', '                train_loader.set_epoch(epoch)  #',
     '                train_loader.set_epoch(0)  #',
     ['tests/test_stopping.py::test_every_mode_resumes_a_mid_epoch_checkpoint_to_the_same_end', 'tests/test_modes.py::test_two_processes_match_single_and_only_rank_0_writes_prints_and_scans']),
    ('train_single.py', 'skip_first_batches(train_loader, state.step * args.accumulate)',
     'skip_first_batches(train_loader, 0)',
     ['tests/test_reliability.py::test_ctrl_c_anywhere_then_resume_equals_the_straight_run']),
    ('src/state.py', '            sums += self.partial["sums"].to(device)',
     '            sums += 0',
     ['tests/test_reliability.py::test_ctrl_c_anywhere_then_resume_equals_the_straight_run']),
    ('src/checkpoint.py', '        sums = rows[rank].clone()', '        sums = rows.sum(dim=0) if rank == 0 else 0 * rows[0]',
     ['tests/test_stopping.py::test_signals_under_torchrun_stop_every_rank_at_one_step_and_resume_to_the_same_end']),
    ('src/state.py', 'earlier = self.partial["train_seconds"] if self.partial else 0.0',
     'earlier = 0.0',
     ['tests/test_reliability.py::test_ctrl_c_anywhere_then_resume_equals_the_straight_run']),
    ('src/state.py', 'return every is not None and self.run_step % every == 0 and self.step < self.steps_per_epoch',
     'return False',
     ['tests/test_stopping.py::test_step_checkpoints_hold_the_steps_and_change_nothing']),
    ('src/stopping.py', 'self.handlers = {number: signal.signal(number, self._note) for number in STOP_SIGNALS}',
     'self.handlers = {}',
     ['tests/test_reliability.py::test_ctrl_c_anywhere_then_resume_equals_the_straight_run']),
    ('src/stopping.py', 'work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True)',
     'work = dist.all_reduce(tensor.zero_(), op=dist.ReduceOp.MAX, async_op=True)',
     ['tests/test_stopping.py::test_signals_under_torchrun_stop_every_rank_at_one_step_and_resume_to_the_same_end']),
    ('src/stopping.py', 'dist.all_reduce(tensor, op=dist.ReduceOp.MAX)\n', 'dist.all_reduce(tensor.zero_(), op=dist.ReduceOp.MAX)\n',
     ['tests/test_stopping.py::test_signals_under_torchrun_stop_every_rank_at_one_step_and_resume_to_the_same_end']),
    ('src/datasets.py', '    ignore_stop_signals()\n    ignore_pillow_warnings()\n    threading.Thread(',
     '    ignore_pillow_warnings()\n    threading.Thread(',
     ['tests/test_stopping.py::test_signals_under_torchrun_stop_every_rank_at_one_step_and_resume_to_the_same_end']),
    ('src/errors.py', '        leave_together()\n        return EXIT_STOPPED',
     '        leave_together()\n        return 0',
     ['tests/test_reliability.py::test_ctrl_c_anywhere_then_resume_equals_the_straight_run']),
    ('src/ranks.py', '            or int(os.environ.get("SLURM_RESTART_COUNT", 0)) > 0 or _restarted_by_ray)', ' or _restarted_by_ray)',
     ['tests/test_stopping.py::test_restarted_is_a_torchrun_restart_or_a_requeued_slurm_job',
      'tests/test_stopping.py::test_every_mode_resumes_a_mid_epoch_checkpoint_to_the_same_end']),
    ('src/heartbeat.py', '    if now - beat["time"] > STALE:', '    if False:',
     ['tests/test_hung_rank.py::test_the_line_names_the_ranks_that_did_not_arrive_and_the_lowest_other_rank_says_it',
      'tests/test_hung_rank.py::test_a_rank_stopped_with_sigstop_is_named_within_the_timeout',
      'tests/test_hung_rank.py::test_with_a_stop_pending_a_rank_not_heard_from_for_stale_seconds_ends_the_others']),
    ('src/heartbeat.py', '        if said is None and beat is not None and beat["order"] < mine["order"]:', '        if False:',
     ['tests/test_hung_rank.py::test_the_line_names_the_ranks_that_did_not_arrive_and_the_lowest_other_rank_says_it']),
    ('train_ddp.py', 'with watch_ranks(store, args.dist_timeout, device) as heartbeat, lock_outputs(args), rank_0_tracker(args) as tracker:',
     'with Heartbeat() as heartbeat, lock_outputs(args), rank_0_tracker(args) as tracker:',
     ['tests/test_hung_rank.py::test_a_rank_stopped_with_sigstop_is_named_within_the_timeout']),
    ('src/tools/chaos.py', '                os.kill(target, signal.SIGTERM if event["means"] == "sigterm" else signal.SIGINT)',
     '                pass', ['tests/test_chaos.py::test_two_stops_end_bit_for_bit_where_the_straight_run_does']),
    ('docs/slurm/train.sbatch', '    kill -USR1 "$srun_pid"', '    kill -TERM "$srun_pid"',
     ['tests/test_slurm.py::test_sigusr1_before_the_time_limit_is_forwarded_and_the_job_requeued']),
    ('docs/slurm/train.sbatch', '--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 ', '',
     ['tests/test_slurm.py::test_one_torchrun_per_node_with_a_rendezvous_on_the_first_node']),
    ('docs/slurm/train.sbatch', '    kill -USR1 "$srun_pid"', '    :',
     ['tests/test_slurm.py::test_sigusr1_before_the_time_limit_is_forwarded_and_the_job_requeued']),
    ('docs/slurm/train.sbatch', '    scontrol requeue "$SLURM_JOB_ID"', '    :',
     ['tests/test_slurm.py::test_a_requeue_follows_a_stopped_process_only']),
    # Resuming across process counts and after frozen epochs, dropout's keep test and keys, outputs and
    # the run lock, an infinite loss.
    ('src/checkpoint.py', 'rows.sum(dim=0) if rank == 0', 'rows[0] if rank == 0',
     ['tests/test_stopping.py::test_a_two_rank_step_checkpoint_resumes_in_one_process_with_both_ranks_sums']),
    ('src/dropout.py', '    return h >= threshold', '    return h > threshold',
     ['tests/test_dropout.py::test_an_element_drawn_exactly_at_p_is_kept']),
    ('src/dropout.py', 'return derive_seed(seed, epoch, index, DROPOUT)', 'return derive_seed(seed, epoch, index)',
     ['tests/test_dropout.py::test_the_loader_hands_each_sample_its_key_for_its_epoch']),
    ('src/checkpoint.py', '"freeze_epochs", "sync_bn", "ema_decay")', '"freeze_epochs", "sync_bn")',
     ['tests/test_reliability.py::test_resume_refuses_another_run']),
    ('src/checkpoint.py', '"freeze_epochs", "sync_bn", "ema_decay")', '"freeze_epochs", "ema_decay")',
     ['tests/test_reliability.py::test_resume_refuses_another_run']),
    ('src/outputs.py', 'for name in ("best", "info", "last", "history")', 'for name in ("best", "info", "history")',
     ['tests/test_outputs.py::test_a_run_stopped_in_its_first_epoch_is_not_replaced_unless_told']),
    ('src/outputs.py', 'real.startswith(folder_real.rstrip(os.sep) + os.sep)', 'real.startswith(folder_real)',
     ['tests/test_outputs.py::test_an_output_beside_the_inputs_is_not_inside_them_and_a_hard_link_of_another_output_is']),
    ('src/outputs.py', 'if real == other_real or (inode is not None and inode == other_inode):', 'if real == other_real:',
     ['tests/test_outputs.py::test_an_output_beside_the_inputs_is_not_inside_them_and_a_hard_link_of_another_output_is']),
    ('src/outputs.py', '    def __exit__(self, *exc) -> None:\n        self.release()',
     '    def __exit__(self, *exc) -> None:\n        pass',
     ['tests/test_outputs.py::test_a_run_lets_go_of_its_folder_when_it_ends']),
    ('src/divergence.py', 'loss = float(sums[LOSS])\n    if not math.isfinite(loss):', 'loss = float(sums[LOSS])\n    if math.isnan(loss):',
     ['tests/test_diverged.py::test_an_infinite_loss_stops_the_run_as_a_nan_one_does']),
    ('src/freeze.py', 'yield Stage(range(max(start, end), args.epochs)', 'yield Stage(range(end, args.epochs)',
     ['tests/test_freeze.py::test_the_stages_run_each_remaining_epoch_once_frozen_or_not']),
    ('src/checkpoint.py', '(int(state["epoch"]), int(state.get("step", 0)))', '(int(state["epoch"]), 0)',
     ['tests/test_two_ranks.py::test_every_rank_resumes_from_the_newest_last_pth_of_any_node']),
    # The SLURM script takes srun's own exit code, also when srun ends right after the trap forwarded USR1.
    ('docs/slurm/train.sbatch', '[ "$asked_to_stop" -eq 1 ] && [ "$code" -eq $((128 + $(kill -l USR1))) ] || break', 'break',
     ['tests/test_slurm.py::test_sigusr1_before_the_time_limit_is_forwarded_and_the_job_requeued']),

    # Each script teaches its mode: the training state, the stop signals, the loaders, the process group.
    ('src/checkpoint.py', '            load_optimizer(optimizer, state["optimizer"])\n            if average is not None:\n                average.load(getattr(model, "_orig_mod", model), state["average"])',
     '            if average is not None:\n                average.load(getattr(model, "_orig_mod", model), state["average"])\n            load_optimizer(optimizer, state["optimizer"])',
     ['tests/test_sharded_checkpoint.py::test_a_ddp_last_pth_resumes_under_fsdp_on_one_process']),
    ('src/fsdp.py', '    return {key: value.clone() if value.untyped_storage().data_ptr() in live else value\n            for key, value in state.items()}',
     '    return state',
     ['tests/test_fsdp.py::test_the_whole_model_is_a_copy_that_the_next_step_leaves_as_it_was',
      'tests/test_fsdp.py::test_an_fsdp_run_resumed_with_ema_ends_bit_for_bit_as_the_straight_one']),
    ('src/datasets.py', '    threading.Thread(target=_end_with, args=(training_pid,), name=',
     '    pass  # threading.Thread(target=_end_with, args=(training_pid,), name=',
     ['tests/test_reliability.py::test_the_loader_workers_end_with_a_killed_training_process']),
    ('src/stopping.py', '        for number, handler in self.handlers.items():\n            signal.signal(number, handler)',
     '        for number, handler in self.handlers.items():\n            pass',
     ['tests/test_in_process.py::test_a_stopped_run_gives_back_the_signal_handlers']),
    ('src/outputs.py', '        for lock in held:\n            lock.release()',
     '        for lock in held:\n            pass',
     ['tests/test_in_process.py::test_main_twice_in_one_process_writes_what_two_processes_write']),
    ('src/outputs.py', '        paths["last"].unlink(missing_ok=True)',
     '        pass',
     ['tests/test_outputs.py::test_overwrite_removes_the_earlier_runs_last_pth_before_any_work']),
    ('src/outputs.py', '    if not held or (args.resume and (paths["last"] in held or shards in held)):',
     '    if not held or args.resume:',
     ['tests/test_outputs.py::test_a_new_run_does_not_replace_an_earlier_runs_files_unless_told']),
    ('src/process_group.py', '    if missing:\n',
     '    if False:\n',
     ['tests/test_outputs.py::test_launcher_variables_in_part_are_one_line']),
    ('src/stopping.py', '    arguments = [argument for argument in command if argument != "--overwrite"]',
     '    arguments = list(command)',
     ['tests/test_in_process.py::test_a_stopped_run_gives_back_the_signal_handlers']),
    ('src/state.py', '            close_bars()\n',
     '',
     ['tests/test_reliability.py::test_ctrl_c_anywhere_then_resume_equals_the_straight_run']),
    ('src/state.py', '    if not (dist.is_initialized() and dist.get_world_size() > 1):\n        return mine.unsqueeze(0)',
     '    if True:\n        return mine.unsqueeze(0)',
     ['tests/test_stopping.py::test_signals_under_torchrun_stop_every_rank_at_one_step_and_resume_to_the_same_end']),
    ('train_ddp.py', "        torch.cuda.set_device(device)  # the process's",
     "        pass  # the process's",
     ['tests/test_scripts.py::test_each_script_calls_its_modes_api_and_no_other_modes']),
    # --sync-bn's layer without torch's mask (src/batch_norm.py): each rank's own count, no host read,
    # one compiled graph, torch's kernels on CUDA.
    ("src/batch_norm.py", "            average = batches.to(running_mean.dtype).reciprocal()",
     "            average = 1.0 / float(batches)",
     ["tests/test_sync_bn.py::test_nothing_in_the_layer_reads_a_tensor_on_the_host", "gpu:gpu"]),
    ("src/batch_norm.py", "        means, invstds, counts = rows.split([channels, channels, 1], dim=1)\n",
     "        rows = rows[rows[:, -1] >= 1]  # torch's mask\n        means, invstds, counts = rows.split([channels, channels, 1], dim=1)\n",
     ["tests/test_sync_bn.py::test_nothing_in_the_layer_reads_a_tensor_on_the_host", "tests/test_sync_bn.py::test_the_layer_compiles_in_one_graph"]),
    ("src/batch_norm.py", "        counts = counts.reshape(-1)\n", "        counts = counts.reshape(-1).mean().expand(counts.numel())\n",
     ["tests/test_sync_bn.py::test_two_ranks_normalise_as_one_batch_norm_of_the_whole_batch"]),
    ("src/batch_norm.py", "rows.select(0, dist.get_rank())", "rows.select(0, 0)",
     ["tests/test_sync_bn.py::test_two_ranks_normalise_as_one_batch_norm_of_the_whole_batch"]),
    ("src/batch_norm.py", "            running_mean.lerp_(into[0], average)", "            running_mean.copy_(into[0])",
     ["tests/test_sync_bn.py::test_two_ranks_normalise_as_one_batch_norm_of_the_whole_batch"]),
    ("src/batch_norm.py", "ctx.save_for_backward(x, weight, mean, invstd, counts.to(torch.int32))",
     "ctx.save_for_backward(x, weight, mean, invstd, counts)",
     ["tests/test_sync_bn.py::test_two_ranks_normalise_as_one_batch_norm_of_the_whole_batch"]),
    ("src/batch_norm.py", 'return CUDA_KERNELS if device.type == "cuda" else CPU_KERNELS', "return CPU_KERNELS",
     ["tests/test_sync_bn.py::test_the_cuda_path_calls_torchs_kernels_and_the_cpu_path_the_same_steps"]),
    ("src/batch_norm.py", "    if x.numel() == 0:  # a shape: known on the host", "    if False:",
     ["tests/test_sync_bn.py::test_an_empty_micro_batch_is_refused_before_any_collective"]),
    # Per-sample dropout made cheap, the same bits: the int32 steps, the per-batch and per-shape
    # parts, the Triton kernel, the scaling; the --dropout-cost benchmark; the MFU's FLOPs.
    ('src/dropout.py', '    shifted &= (1 << (32 - shift)) - 1\n', '',
     ['tests/test_dropout.py::test_the_masks_outputs_and_gradients_are_the_old_formulas_bit_for_bit']),
    ('src/dropout.py', '    h ^= -_TOP  # the top bit flipped', '    h ^= 0  # the top bit flipped',
     ['tests/test_dropout.py::test_the_masks_outputs_and_gradients_are_the_old_formulas_bit_for_bit']),
    ('src/dropout.py', '    h.mul_(_C2_32)', '    h.mul_(_C1_32)',
     ['tests/test_dropout.py::test_the_masks_outputs_and_gradients_are_the_old_formulas_bit_for_bit',
      'tests/test_dropout.py::test_keep_bits_are_the_old_draws']),
    ('src/dropout.py', '    return _to_int32(h ^ (h >> 16))', '    return _to_int32(h)',
     ['tests/test_dropout.py::test_the_masks_outputs_and_gradients_are_the_old_formulas_bit_for_bit']),
    ('src/dropout.py', "unit.drawn = (wholes if isinstance(unit, SampleStochasticDepth) else parts)[unit.unit - low]",
     "unit.drawn = (wholes if isinstance(unit, SampleStochasticDepth) else parts)[0]",
     ['tests/test_dropout.py::test_the_masks_outputs_and_gradients_are_the_old_formulas_bit_for_bit']),
    ('src/dropout.py', '        return _scaled(grad, kept, ctx.scale), None, None', '        return grad, None, None',
     ['tests/test_dropout.py::test_the_masks_outputs_and_gradients_are_the_old_formulas_bit_for_bit']),
    ('src/dropout.py', '        return torch.ops.aten.native_dropout_backward(t, kept, scale)',
     '        return torch.ops.aten.native_dropout_backward(t, kept, 1.0)',
     ['tests/test_dropout.py::test_the_gpus_fused_scaling_computes_the_cpus_bits']),
    ('src/dropout.py', '    parts = wholes = rows.unbind()', '    parts = wholes = rows',
     ['tests/test_dropout.py::test_set_samples_draws_every_units_per_sample_part_in_the_same_ops_for_3_units_or_60']),
    ('src/dropout.py', '        found = _ELEMENTS[key] = _element_part(elements, device)',
     '        found = _element_part(elements, device)',
     ['tests/test_dropout.py::test_a_units_forward_reads_no_key_and_a_shape_seen_before_makes_no_element_part']),
    ('src/dropout.py', '        h = h ^ ((h >> 16) & 0xFFFF)  # its share of the next mix', '        h = h  # its share of the next mix',
     ['tests/test_dropout.py::test_the_triton_kernel_draws_the_old_masks']),
    ('src/dropout.py', '        h = h ^ -2147483648\n', '',
     ['tests/test_dropout.py::test_the_triton_kernel_draws_the_old_masks']),
    ('src/dropout.py', '        h = h * -2073254261\n        h = h ^ ((h >> 16) & 0xFFFF)  # the per-element part',
     '        h = h * 0x846CA68B\n        h = h ^ ((h >> 16) & 0xFFFF)  # the per-element part',
     ['tests/test_dropout.py::test_the_triton_kernel_compiles_for_an_h100']),
    ('src/tools/benchmark.py', '                best[i] = min(best[i], clock() - start)', '                best[i] = clock() - start',
     ['tests/test_benchmark.py::test_dropout_seconds_times_torchs_dropout_and_the_per_sample_one_alternately_on_one_thread']),
    ('src/tools/benchmark.py', '            for i, layer in enumerate((torchs, ours)):',
     '            for i, layer in enumerate((torchs, torchs)):',
     ['tests/test_benchmark.py::test_dropout_seconds_times_torchs_dropout_and_the_per_sample_one_alternately_on_one_thread']),
    ('src/tools/benchmark.py', "results.append((f\"per-sample dropout at {size}: {ours / torchs:.2f}x torch's time \"\n"
     "                        f\"(target <= {DROPOUT_TARGET:g})\", ours / torchs <= DROPOUT_TARGET))",
     "results.append((f\"per-sample dropout at {size}: {ours / torchs:.2f}x torch's time \"\n"
     "                        f\"(target <= {DROPOUT_TARGET:g})\", True))",
     ['tests/test_benchmark.py::test_the_dropout_cost_table_shows_its_timings_and_counts']),
    ('checks/gpu_benchmark.py', '        model(image).sum().backward()\n', '        model(image).sum()\n',
     ['tests/test_gpu_benchmark_flops.py::test_vgg16_counts_three_forwards_but_the_first_layers_input_gradient']),
    ('checks/gpu_benchmark.py', '"MFU": rate * flops / peak if peak else None', '"MFU": rate * flops / 2 / peak if peak else None',
     ['tests/test_gpu_benchmark_flops.py::test_the_mfu_is_images_per_second_times_the_counted_flops_over_the_peak']),
    # The augmentation recipe (src/augment.py): each draw a function of the sample's key alone, what it claims.
    ('src/augment.py', 'with drawing(self.seed, epoch, index, POLICY):', 'with drawing(self.seed, 0, index, POLICY):',
     ['tests/test_augment.py::test_trivial_augment_draws_each_operation_and_magnitude_equally_often']),
    ('src/augment.py', 'with drawing(self.seed, epoch, index, ERASE):', 'with drawing(self.seed, epoch, 0, ERASE):',
     ['tests/test_augment.py::test_random_erasing_erases_with_probability_p_a_box_of_the_documented_area']),
    ('src/augment.py', 'derive_seed(seed, epoch, index, PARTNER)', 'derive_seed(seed, epoch, 0, PARTNER)',
     ['tests/test_augment.py::test_the_partner_is_drawn_uniformly_from_the_others_of_the_split_and_loaded_by_the_dataset']),
    ('src/augment.py', 'with drawing(self.seed, epoch, index, MIX):', 'with drawing(self.seed, epoch, 0, MIX):',
     ['tests/test_augment.py::test_lambda_follows_beta_alpha_alpha']),
    ('src/augment.py', 'image = augment(image, crop_params(self.seed, epoch, index, image.shape[-1]))',
     'image = augment(image, crop_params(self.seed, 0, index, image.shape[-1]))',
     ['tests/test_augment.py::test_crop_and_flip_are_the_draws_of_crop_params_bit_for_bit']),
    ('src/augment.py', 'return image, target, sample_key(self.seed, epoch, index)',
     'return image, target, sample_key(self.seed, epoch, position)',
     ['tests/test_augment.py::test_crop_and_flip_are_the_draws_of_crop_params_bit_for_bit']),
    ('src/augment.py', 'POLICY, ERASE, PARTNER, MIX = 2, 3, 4, 5', 'POLICY, ERASE, PARTNER, MIX = 2, 3, 4, 3',
     ['tests/test_augment.py::test_each_draw_of_a_key_has_a_stream_of_its_own']),
    ('src/augment.py', 'POLICY, ERASE, PARTNER, MIX = 2, 3, 4, 5', 'POLICY, ERASE, PARTNER, MIX = 1, 3, 4, 5',
     ['tests/test_augment.py::test_each_draw_of_a_key_has_a_stream_of_its_own']),
    ('src/augment.py', '        torch.default_generator.manual_seed(derive_seed(seed, epoch, index, stream))\n', '',
     ['tests/test_augment.py::test_a_sample_is_the_same_whatever_process_worker_or_global_seed_computes_it']),
    ('src/augment.py', 'with torch.random.fork_rng(devices=[]):', 'with contextlib.nullcontext():',
     ['tests/test_augment.py::test_a_sample_is_the_same_whatever_process_worker_or_global_seed_computes_it']),
    ('src/augment.py', 'torch.zeros((), dtype=torch.int64).share_memory_()', 'torch.zeros((), dtype=torch.int64)',
     ['tests/test_augment.py::test_a_sample_is_the_same_whatever_process_worker_or_global_seed_computes_it']),
    ('src/augment.py', 'return drawn + (drawn >= position)', 'return drawn',
     ['tests/test_augment.py::test_the_partner_is_drawn_uniformly_from_the_others_of_the_split_and_loaded_by_the_dataset']),
    ('src/augment.py', 'other_image = self.augmented(other_image, epoch, other)',
     'other_image = self.augmented(other_image, epoch, index)',
     ['tests/test_augment.py::test_mixup_blends_the_two_augmented_images_and_their_labels_by_lambda',
      'tests/test_augment.py::test_cutmix_pastes_a_box_of_the_partner_and_lambda_is_the_share_left']),
    ('src/augment.py', 'return mixers[0] if len(mixers) == 1 else v2.RandomChoice(mixers)', 'return mixers[0]',
     ['tests/test_augment.py::test_mixup_and_cutmix_each_mix_half_of_the_samples_with_both_alphas']),
    ('src/augment.py', 'torch.tensor(labels))', 'torch.tensor(labels[::-1]))',
     ['tests/test_augment.py::test_a_mixed_targets_loss_is_the_mix_of_the_two_losses_with_label_smoothing_once',
      'tests/test_augment.py::test_cutmix_pastes_a_box_of_the_partner_and_lambda_is_the_share_left']),
    ('src/augment.py', 'images[0].round().clamp(0, 255)', 'images[0].clamp(0, 255)',
     ['tests/test_augment.py::test_mixup_blends_the_two_augmented_images_and_their_labels_by_lambda']),
    ('src/augment.py', 'ERASE_FILL = tuple(round(255 * mean) for mean in IMAGENET_MEAN)',
     'ERASE_FILL = tuple(int(255 * mean) for mean in IMAGENET_MEAN)',
     ['tests/test_augment.py::test_random_erasing_erases_with_probability_p_a_box_of_the_documented_area']),
    ('src/augment.py', 'v2.RandAugment(magnitude=args.ra_magnitude,', 'v2.RandAugment(magnitude=9,',
     ['tests/test_augment.py::test_randaugment_applies_two_operations_at_ra_magnitude']),
    ('src/augment.py', 'v2.AugMix(severity=args.augmix_severity,', 'v2.AugMix(severity=3,',
     ['tests/test_augment.py::test_augmix_draws_its_magnitudes_below_augmix_severity']),
    ('src/metrics.py', 'labels = targets.argmax(dim=1) if soft else targets',
     'labels = (targets[:, 1] > 0).long() if soft else targets',
     ['tests/test_augment.py::test_batch_sums_of_soft_targets_count_the_dominant_label']),
    ('src/metrics.py', 'w_dog = targets[:, 1].float() if soft', 'w_dog = labels.float() if soft',
     ['tests/test_augment.py::test_batch_sums_of_soft_targets_count_the_dominant_label']),
    ('src/freeze.py', '    changing = augments(args)\n', '    changing = ["--augment"] if args.augment else []\n',
     ['tests/test_augment.py::test_the_feature_cache_is_not_used_with_any_augmentation_or_mixing']),
    ('src/checkpoint.py', '"mixup_alpha": 0.0, "cutmix_alpha": 0.0}', '"mixup_alpha": 0.0}',
     ['tests/test_augment.py::test_resume_refuses_another_augmentation']),
    ('src/checkpoint.py', 'trained = saved.get(key, ADDED_LATER.get(key))', 'trained = saved.get(key)',
     ['tests/test_augment.py::test_a_last_pth_older_than_the_flags_resumes_with_their_defaults']),
    ('src/cli.py', 'add("--random-erase", metavar="P", type=_fraction(False, False)', 'add("--random-erase", metavar="P", type=float',
     ['tests/test_augment.py::test_bad_augmentation_values_are_one_line_and_exit_2']),
    ('src/cli.py', 'add("--ra-magnitude", type=between(*RA_MAGNITUDES)', 'add("--ra-magnitude", type=int',
     ['tests/test_augment.py::test_bad_augmentation_values_are_one_line_and_exit_2']),
    # The tools write only their own files, never a run's nor into a run in progress; names that fit;
    # every image used or named; predict's list from rank 0; the report's fields; EXIF and 16-bit decoding.
    ('src/outputs.py', '    if path.suffix == ".pth":\n        return "a checkpoint (.pth)"', '    if False:\n        return "a checkpoint (.pth)"',
     ['tests/test_tool_outputs.py::test_the_tools_never_write_over_a_runs_files_nor_a_file_not_theirs']),
    ('src/outputs.py', '    if path.name == "history.json" and any(', '    if False and any(',
     ['tests/test_tool_outputs.py::test_the_tools_never_write_over_a_runs_files_nor_a_file_not_theirs']),
    ('src/outputs.py', '    if os.path.lexists(path) and not overwrite and not ours(path):', '    if False:',
     ['tests/test_tool_outputs.py::test_the_tools_never_write_over_a_runs_files_nor_a_file_not_theirs']),
    ('src/tools/predict.py', 'return starts_with(path, tuple(header.encode() for header in HEADERS))', 'return False',
     ['tests/test_tool_outputs.py::test_the_tools_never_write_over_a_runs_files_nor_a_file_not_theirs']),
    ('src/tools/export.py', 'return any(entry.key == "format" and entry.value == FORMAT for entry in model.metadata_props)', 'return True',
     ['tests/test_tool_outputs.py::test_the_tools_never_write_over_a_runs_files_nor_a_file_not_theirs']),
    ('src/outputs.py', '        if error.errno in (errno.EACCES, errno.EAGAIN):', '        if False:',
     ['tests/test_tool_outputs.py::test_no_tool_writes_into_the_folder_of_a_run_in_progress']),
    ('src/outputs.py', '    check_not_in_use(path.parent, flag)\n', '',
     ['tests/test_tool_outputs.py::test_no_tool_writes_into_the_folder_of_a_run_in_progress']),
    ('src/outputs.py', '    if len(name) > room:', '    if False:',
     ['tests/test_tool_outputs.py::test_a_name_that_fits_is_saved_and_one_that_does_not_is_refused_at_start', 'tests/test_tool_outputs.py::test_temporary_names_fit_and_are_found_by_name_not_by_pattern']),
    ('src/outputs.py', '        probe_folder(path.parent)\n        probe_names(path)\n', '        probe_folder(path.parent)\n',
     ['tests/test_tool_outputs.py::test_a_name_that_fits_is_saved_and_one_that_does_not_is_refused_at_start']),
    ('src/outputs.py', '                probe_names(path)\n            except OSError as error:', '                pass\n            except OSError as error:',
     ['tests/test_tool_outputs.py::test_a_name_that_fits_is_saved_and_one_that_does_not_is_refused_at_start']),
    ('src/outputs.py', '    return [folder / name for name in names if name.startswith(prefix) and name.endswith(".tmp")]', '    return list(folder.glob(prefix + "*.tmp"))',
     ['tests/test_tool_outputs.py::test_temporary_names_fit_and_are_found_by_name_not_by_pattern']),
    ('src/outputs.py', '            if not os.path.isdir(above):', '            if False:',
     ['tests/test_tool_outputs.py::test_messages_name_what_the_command_has']),
    ('src/outputs.py', '    check_outputs([(flag, path)], inputs=inputs, advice=advice)\n', '',
     ['tests/test_tool_outputs.py::test_report_output_that_is_a_named_pipe_or_a_link_is_refused_without_opening_it']),
    ('src/errors.py', '        print(interrupted, file=sys.stderr)', '        print(INTERRUPTED, file=sys.stderr)',
     ['tests/test_tool_outputs.py::test_messages_name_what_the_command_has']),
    ('src/tools/report.py', '    if not (folder / "best.pth").is_file():', '    if False:',
     ['tests/test_tool_outputs.py::test_messages_name_what_the_command_has']),
    ('src/tools/benchmark.py', '    claim_folder(args.out_dir, MARK, WRITES, "src.tools.benchmark", "the benchmark", "--out-dir ")', '    args.out_dir.mkdir(parents=True, exist_ok=True)',
     ['tests/test_tool_outputs.py::test_a_tool_that_owns_a_folder_refuses_one_it_did_not_write']),
    ('src/tools/compare_recipes.py', '    claim_folder(args.out_dir, MARK, WRITES, "src.tools.compare_recipes", "the recipe comparison", "--out-dir ")', '    args.out_dir.mkdir(parents=True, exist_ok=True)',
     ['tests/test_tool_outputs.py::test_a_tool_that_owns_a_folder_refuses_one_it_did_not_write']),
    ('src/tools/chaos.py', '    claim_folder(work, MARK, WRITES, "src.tools.chaos", "the chaos check", "--work-dir ")', '    work.mkdir(parents=True, exist_ok=True)',
     ['tests/test_tool_outputs.py::test_a_tool_that_owns_a_folder_refuses_one_it_did_not_write']),
    ('src/tools/predict.py', '                files, others = from_rank_0(lambda: listed(args))',
     '                files, others = listed(args)',
     ['tests/test_every_image.py::test_under_torchrun_every_rank_predicts_its_share_of_rank_0s_list']),
    ('src/datasets.py', '            said = not_used_line(data_dir, list(frame["filename"]), csv_file)', '            said = None',
     ['tests/test_every_image.py::test_images_added_after_prepare_are_named_as_not_used']),
    ('src/datasets.py', '        said = not_used_line(data_dir, [*frame["filename"], *rejected])', '        said = None',
     ['tests/test_every_image.py::test_files_no_label_rule_covers_are_named_and_a_labelled_tiff_is_used']),
    ('src/tools/prepare.py', 'return len(frame) - dogs, dogs, rejected, not_used_line(data_dir, [*frame["filename"], *rejected])', 'return len(frame) - dogs, dogs, rejected, None',
     ['tests/test_every_image.py::test_files_no_label_rule_covers_are_named_and_a_labelled_tiff_is_used']),
    ('src/datasets.py', '        label = _label_of(Path(name)) if Path(name).suffix.lower() in IMAGE_SUFFIXES else None', '        label = _label_of(Path(name)) if Path(name).suffix.lower() in IMAGE_SUFFIXES - {".tif", ".tiff"} else None',
     ['tests/test_every_image.py::test_files_no_label_rule_covers_are_named_and_a_labelled_tiff_is_used']),
    ('src/datasets.py', '            elif int(path.stem) in self.files:', '            elif False:',
     ['tests/test_every_image.py::test_kaggle_test_folder_names_what_it_does_not_predict_and_refuses_an_id_twice']),
    ('src/datasets.py', '                self.others.append(path.name + ("/" if path.is_dir() else ""))', '                pass',
     ['tests/test_every_image.py::test_kaggle_test_folder_names_what_it_does_not_predict_and_refuses_an_id_twice']),
    ('src/datasets.py', 'path.stem.isdigit() and path.stem.isascii()', 'path.stem.isdigit()',
     ['tests/test_every_image.py::test_kaggle_test_folder_names_what_it_does_not_predict_and_refuses_an_id_twice']),
    ('src/image_files.py', '    return [int(part) if part.isdecimal() else', '    return [int(part) if part.isdigit() else',
     ['tests/test_every_image.py::test_a_name_holding_a_digit_that_int_refuses_sorts_as_text']),
    ('src/tools/predict.py', "are not images{f' ({some(others)})' if others else ''}", 'are not images',
     ['tests/test_predict.py::test_a_mixed_folder_gives_the_validation_pass_p_dog']),
    ('src/image_files.py', '    if image.getexif().get(ORIENTATION, 1) != 1:', '    if False:',
     ['tests/test_every_image.py::test_exif_orientation_turns_the_image_as_a_viewer_shows_it']),
    ('src/image_files.py', '    if image.mode in SIXTEEN_BIT:', '    if False:',
     ['tests/test_every_image.py::test_a_16_bit_grayscale_png_is_its_high_byte_not_white']),
    ('src/tools/report.py', '        elif not test(info[key]):', '        elif False:',
     ['tests/test_report_input.py::test_a_hand_edited_or_older_run_file_is_one_line_naming_the_field']),
    ('src/tools/report.py', '            if required:', '            if False:',
     ['tests/test_report_input.py::test_a_hand_edited_or_older_run_file_is_one_line_naming_the_field']),
    ('src/tools/report.py', '            if not ok:', '            if False:',
     ['tests/test_report_input.py::test_a_hand_edited_or_older_run_file_is_one_line_naming_the_field']),
    ('src/tools/report.py', '        if flags is None or not isinstance(flags.get("data_dir"), str):', '        if flags is None:',
     ['tests/test_report_input.py::test_a_run_that_does_not_say_its_data_folder_needs_data_dir']),
    ('src/tools/report.py', '        images.append({"name": original(name), ', '        images.append({"name": name, ',
     ['tests/test_report_input.py::test_predictions_come_back_unguarded_and_images_only_from_the_folders_of_the_page']),
    ('src/tools/report.py', '    if not any(real == root or real.startswith(root.rstrip(os.sep) + os.sep)', '    if False and not any(real == root or real.startswith(root.rstrip(os.sep) + os.sep)',
     ['tests/test_report_input.py::test_predictions_come_back_unguarded_and_images_only_from_the_folders_of_the_page']),
    ('src/cli.py', '    add("--momentum", type=_fraction(False, True), default=0.9,', '    add("--momentum", type=_non_negative, default=0.9,',
     ['tests/test_inputs.py::test_a_momentum_outside_0_to_1_is_refused_as_a_flag']),
    # Experiment tracking (--track, src/tracking.py): one tracked run across a stop, each epoch and step once.
    ('src/tracking.py', 'if epoch in backend.epochs:', 'if epoch in ():',
     ['tests/test_tracking.py::test_mlflow_one_run_across_a_stop_each_epoch_once', 'tests/test_tracking.py::test_wandb_offline_one_run_across_a_stop_each_epoch_once']),
    ('src/tracking.py', 'self.epochs, self.last_step = self._logged()', 'self.epochs, self.last_step = set(), 0',
     ['tests/test_tracking.py::test_mlflow_one_run_across_a_stop_each_epoch_once']),
    ('src/tracking.py', 'self.epochs, self.last_step = wandb_logged(self.folder, self.run_id)', 'self.epochs, self.last_step = set(), 0',
     ['tests/test_tracking.py::test_wandb_offline_one_run_across_a_stop_each_epoch_once']),
    ('src/tracking.py', 'if step <= backend.last_step or not named:', 'if not named:',
     ['tests/test_tracking.py::test_mlflow_one_run_across_a_stop_each_epoch_once', 'tests/test_tracking.py::test_wandb_offline_one_run_across_a_stop_each_epoch_once']),
    ('src/tracking.py', '        for record in history:\n            self.log_epoch(record)', '        pass',
     ['tests/test_tracking.py::test_resumed_history_fills_what_the_run_lacks']),
    ('src/tracking.py', 'self.client.update_run(self.run_id, status="RUNNING")', 'pass',
     ['tests/test_tracking.py::test_mlflow_stopped_run_is_killed_until_its_resume_runs']),
    ('src/tracking.py', 'self.client.set_terminated(self.run_id, status)', 'self.client.set_terminated(self.run_id)',
     ['tests/test_tracking.py::test_mlflow_stopped_run_is_killed_until_its_resume_runs']),
    ('src/tracking.py', 'if saved_id is None:  # a new run: its parameters', 'if True:  # a new run: its parameters',
     ['tests/test_tracking.py::test_mlflow_one_run_across_a_stop_each_epoch_once']),
    ('src/tracking.py', 'experiment, artifact_location=self.artifacts)', 'experiment)',
     ['tests/test_tracking.py::test_mlflow_one_run_across_a_stop_each_epoch_once']),
    ('src/tracking.py', 'self.run_id = saved_id or new_wandb_id()', 'self.run_id = new_wandb_id()',
     ['tests/test_tracking.py::test_wandb_offline_one_run_across_a_stop_each_epoch_once']),
    ('src/tracking.py', 'self.run.finish(exit_code=EXIT_CODES[status])', 'self.run.finish()',
     ['tests/test_tracking.py::test_wandb_offline_one_run_across_a_stop_each_epoch_once']),
    ('src/tracking.py', 'self.mode = os.environ.get("WANDB_MODE") or "offline"', 'self.mode = os.environ.get("WANDB_MODE") or "online"',
     ['tests/test_tracking.py::test_wandb_offline_one_run_across_a_stop_each_epoch_once']),
    ('src/tracking.py', 'mlflow.end_run(status)  #', 'pass  #',
     ['tests/test_tracking.py::test_accelerate_trackers_continue_the_saved_runs']),
    ('src/tracking.py', 'mlflow.set_tracking_uri(self.previous_uri)', 'pass',
     ['tests/test_tracking.py::test_accelerate_trackers_continue_the_saved_runs']),
    ('src/tracking.py', 'self.client.search_experiments(max_results=1)', 'pass',
     ['tests/test_tracking.py::test_a_closed_port_or_an_unknown_scheme_is_one_line_and_exit_2']),
    ('src/tracking.py', 'with _environment(CHECK_REQUEST, override=True):', 'with _environment(CHECK_REQUEST, override=False):',
     ['tests/test_tracking.py::test_a_server_that_never_answers_is_refused_in_bounded_time']),
    ('src/tracking.py', '              file=sys.stderr)\n        self.failed.add(backend.key)\n', '              file=sys.stderr)\n',
     ['tests/test_tracking.py::test_a_tracker_failing_during_the_run_is_one_warning']),
    ('src/tracking.py', '        if position + 7 + length > len(data):  # the last record of a process killed while writing it\n            return\n', '',
     ['tests/test_tracking.py::test_a_wandb_file_cut_short_by_a_kill_reads_up_to_its_last_whole_record']),
    ('src/cli.py', '    check_tracking(parser, args.track, args.tracking_uri)\n', '',
     ['tests/test_tracking.py::test_tracking_flags_refused_when_parsed', 'tests/test_tracking.py::test_a_tracker_not_installed_is_refused_when_parsed']),
    ('src/fsdp.py', '    if not optimizer.state:  # nothing to gather (SGD without momentum keeps none)',
     '    if False:  # nothing to gather (SGD without momentum keeps none)',
     ['tests/test_fsdp.py::test_saves_without_an_optimizer_state_count_no_update_of_the_average']),
    # The modern augmentation in every mode (issue 49): the modes' agreement and a resumed run with the
    # mixing on, validation without augmentation, the report's flags, the recipe comparison, its cost.
    ('src/augment.py', 'with drawing(self.seed, epoch, index, MIX):', 'with contextlib.nullcontext():',
     ['tests/test_recipe.py::test_every_mode_with_the_full_recipe_matches_single']),
    ('src/augment.py', 'with drawing(self.seed, epoch, index, MIX):', 'with contextlib.nullcontext():',
     ['tests/test_recipe.py::test_resume_in_the_middle_of_the_schedule_equals_the_straight_run']),
    ('train_single.py', 'val_loader = DataLoader(Subset(dataset, data.val_idx), args.batch_size',
     'val_loader = DataLoader([TrainSplit(dataset, data.val_idx, args)[i][:2] for i in range(len(data.val_idx))], args.batch_size',
     ['tests/test_augment.py::test_validation_with_every_augmentation_flag_is_that_without_them_and_trainings_own']),
    ('src/checkpoint.py', 'for key, value in args.as_dict().items() if key not in ("local_rank", "command", "mode")}}',
     'for key, value in args.as_dict().items() if key not in ("local_rank", "command", "mode", *ADDED_LATER)}}',
     ['tests/test_report.py::test_every_flag_shows_the_recipe_the_run_was_trained_with']),
    # Found by mypy (issue 55): a last found by the scan and gone when it is read.
    ('src/checkpoint.py', '    if state is None:\n        raise _gone(path)', '    if False:\n        raise _gone(path)',
     ['tests/test_resume_rules.py::test_a_last_pth_removed_between_its_scan_and_its_read_is_one_line']),
    ('src/checkpoint.py', '    if whole is None:\n        raise _gone(folder)', '    if False:\n        raise _gone(folder)',
     ['tests/test_resume_rules.py::test_a_last_dcp_removed_between_its_scan_and_its_read_is_one_line']),
    ('src/config.py', '        kept = {*self.flags, "command", "mode"}', '        kept = {field.name for field in dataclasses.fields(self)}',
     ['tests/test_types.py::test_parse_args_records_the_flags_its_parser_has_as_the_namespace_did']),
    ('src/config.py', '    ema_decay: float | None\n', '',
     ['tests/test_types.py::test_every_flag_of_every_script_is_a_field_in_the_parsers_order']),
    ('src/freeze.py', 'def frozen_until(args: Config) -> int:', 'def frozen_until(args) -> int:',
     ['tests/test_types.py::test_every_function_that_takes_the_flags_annotates_them']),
    # Escaped quotes: the text this entry quotes would otherwise occur twice in this file, here too.
    ('checks/mutations.py', "return captured.decode(errors=\"replace\") if isinstance(captured, bytes) else captured or \"\"",
     "return str(captured or \"\")",
     ['tests/test_mutations.py::test_a_run_that_times_out_logs_its_output_as_text_and_names_what_failed']),
    ('src/tools/chaos.py', '    if last is None:\n        raise UserError(f"{what} {folder} holds no last.pth', '    if False:\n        raise UserError(f"{what} {folder} holds no last.pth',
     ['tests/test_chaos.py::test_a_folder_without_a_last_is_one_line_naming_its_flag']),
    ('src/tools/compare_recipes.py', '    for flag, value in MODERN_RECIPE.items():\n        modern += [flag, value]\n', '',
     ['tests/test_compare_recipes.py::test_runs_differ_only_in_the_recipe']),
    ('src/tools/compare_recipes.py', 'for before, name in zip(names, names[1:]):', 'for before, name in zip(names[:1] * len(names), names[1:]):',
     ['tests/test_compare_recipes.py::test_verdict_compares_each_recipe_with_the_one_before_it']),
    ('src/tools/benchmark.py', '["--batch-size", str(batch), "--seed", "42", *flags]', '["--batch-size", str(batch), "--seed", "42"]',
     ['tests/test_benchmark.py::test_the_training_loader_of_the_loader_rows_takes_the_flags_it_is_given']),
    ('src/tools/benchmark.py', 'best[flags] = max(best.get(flags, 0.0), rate)', 'best[flags] = rate',
     ['tests/test_benchmark.py::test_the_augment_cost_table_shows_each_rows_best_rate_and_cpu_time']),
    ('src/tools/benchmark.py', '    torch.set_num_threads(1)  # as DataLoader sets it in each worker\n', '',
     ['tests/test_benchmark.py::test_augment_cpu_ms_times_each_rows_split_on_one_thread_and_keeps_its_best_round']),
    ('src/tools/benchmark.py', 'best[flags] = min(best.get(flags, math.inf), 1e3 * (clock() - start) / images)',
     'best[flags] = 1e3 * (clock() - start) / images',
     ['tests/test_benchmark.py::test_augment_cpu_ms_times_each_rows_split_on_one_thread_and_keeps_its_best_round']),
    # Careless input to training (issue 47): outputs only onto a run's files, ranks agree on their flags, an error
    # in the middle of an epoch is one line under a launcher, SIGHUP stops, a micro-batch batch norm refuses, a
    # launcher's variables left in a one-process run.
    ('src/outputs.py', '    check_run_outputs(paths)  # before anything is made: a refusal leaves every folder as it was\n', '',
     ['tests/test_training_input.py::test_a_run_replaces_no_file_that_is_not_a_runs_output']),
    ('src/plot.py', '    return head.startswith(PNG_SIGNATURE) and b"tEXt"', '    return True or b"tEXt"',
     ['tests/test_training_input.py::test_a_run_replaces_no_file_that_is_not_a_runs_output']),
    ('src/plot.py', 'figure.savefig(file, format="png", metadata=dict([MARK]))', 'figure.savefig(file, format="png")',
     ['tests/test_training_input.py::test_a_run_replaces_no_file_that_is_not_a_runs_output', 'tests/test_training_input.py::test_best_json_counts_the_processes_of_the_group_and_the_plot_is_a_runs']),
    ('src/outputs.py', 'return isinstance(records, list) and all(isinstance(record, dict) for record in records)', 'return True',
     ['tests/test_training_input.py::test_a_run_replaces_no_file_that_is_not_a_runs_output']),
    ('src/outputs.py', 'return isinstance(info, dict) and isinstance(info.get("sha256"), str)', 'return True',
     ['tests/test_training_input.py::test_a_run_replaces_no_file_that_is_not_a_runs_output']),
    ('src/outputs.py', 'return isinstance(info, dict) and info.get("sha256") == sha256_of(path)', 'return isinstance(info, dict)',
     ['tests/test_training_input.py::test_a_run_replaces_no_file_that_is_not_a_runs_output']),
    ('src/outputs.py', 'return isinstance(info, dict) and info.get("sha256") == sha256_of(path)', 'return False',
     ['tests/test_training_input.py::test_a_run_replaces_no_file_that_is_not_a_runs_output']),
    ('train_ddp.py', "    check_same_flags(args)  # guard: every rank launched with rank 0's flags (paths and --workers aside)\n", '',
     ['tests/test_ranks_agree.py::test_ranks_launched_with_different_flags_are_one_line']),
    ('train_fsdp.py', "    check_same_flags(args)  # guard: every rank launched with rank 0's flags (paths and --workers aside)\n", '',
     ['tests/test_ranks_agree.py::test_ranks_launched_with_different_flags_are_one_line']),
    ('train_accelerate.py', "    check_same_flags(args)  # guard: every process launched with the main process's flags (paths and --workers aside)\n", '',
     ['tests/test_ranks_agree.py::test_ranks_launched_with_different_flags_are_one_line']),
    ('src/process_group.py', 'PER_NODE = ("data_dir", "cache", "checkpoint", ', 'PER_NODE = ("data_dir", "cache", ',
     ['tests/test_ranks_agree.py::test_paths_and_workers_may_differ_per_node_and_weights_are_compared_by_content', 'tests/test_ranks_agree.py::test_ranks_launched_with_different_flags_are_one_line']),
    ('src/process_group.py', '                flags[key] = f"a file of sha256 {sha256_of(flags[key])[:16]}"', '                pass',
     ['tests/test_ranks_agree.py::test_paths_and_workers_may_differ_per_node_and_weights_are_compared_by_content']),
    ('src/process_group.py', '    differ = [key for key in keys if any(flags.get(key) != everyone[0].get(key) for flags in everyone)]', '    differ = [key for key in keys if flags.get(key) != everyone[0].get(key)]',
     ['tests/test_ranks_agree.py::test_paths_and_workers_may_differ_per_node_and_weights_are_compared_by_content']),
    ('src/errors.py', '            tell_the_other_ranks()\n', '',
     ['tests/test_ranks_agree.py::test_a_rank_that_ends_on_bad_input_leaves_the_note_the_others_end_quietly_on',
      'tests/test_ranks_agree.py::test_an_image_unreadable_in_the_middle_of_an_epoch_is_one_line_under_a_launcher']),
    ('src/errors.py', '    if signalled:\n        return\n', '',
     ['tests/test_ranks_agree.py::test_a_quiet_rank_that_took_the_launchers_sigterm_for_a_stop_does_not_wait_for_another']),
    ('src/stopping.py', '            errors.signalled = False\n', '',
     ['tests/test_ranks_agree.py::test_a_quiet_rank_that_took_the_launchers_sigterm_for_a_stop_does_not_wait_for_another']),
    ('src/errors.py', '        mark_ended()  # for the stopped ranks', '        pass  # for the stopped ranks',
     ['tests/test_ranks_agree.py::test_a_stopped_rank_exits_once_every_rank_has_ended']),
    ('src/errors.py', '        while not all(store.check([key]) for key in others) and time.monotonic() < deadline:',
     '        while False:',
     ['tests/test_ranks_agree.py::test_a_stopped_rank_exits_once_every_rank_has_ended']),
    ('src/errors.py', '        return dist.PrefixStore(f"attempt{attempt}", store), dist.get_rank()',
     '        return store, dist.get_rank()',
     ['tests/test_ranks_agree.py::test_the_marks_and_notes_of_an_earlier_restart_attempt_do_not_count']),
    ('src/errors.py', '    except KeyboardInterrupt:  # Ctrl-C again while waiting', '    except ZeroDivisionError:  # Ctrl-C again while waiting',
     ['tests/test_ranks_agree.py::test_the_marks_and_notes_of_an_earlier_restart_attempt_do_not_count']),
    ('src/errors.py', '    except Stopped:\n        leave_together()\n', '    except Stopped:\n',
     ['tests/test_stopping.py::test_signals_under_torchrun_stop_every_rank_at_one_step_and_resume_to_the_same_end',
      'tests/test_tracking_scripts.py::test_torchrun_stopped_resumed_and_restarted_is_one_tracked_run']),
    ('src/errors.py', '        if not isinstance(error, Exception) or not another_rank_said_why():\n', '        if True:\n',
     ['tests/test_ranks_agree.py::test_a_rank_that_ends_on_bad_input_leaves_the_note_the_others_end_quietly_on',
      'tests/test_ranks_agree.py::test_an_image_unreadable_in_the_middle_of_an_epoch_is_one_line_under_a_launcher']),
    ('src/errors.py', 'STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)', 'STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)',
     ['tests/test_hangup.py::test_sighup_stops_the_run_at_a_step_and_resume_goes_on', 'tests/test_hangup.py::test_closing_the_terminal_of_a_run_stops_it_at_a_step']),
    ('src/stopping.py', '            detach_from_closed_terminal(self.terminals)', '            pass',
     ['tests/test_hangup.py::test_closing_the_terminal_of_a_run_stops_it_at_a_step']),
    ('src/cli.py', '            check_batch_norm(args.arch, args.image_size, args.batch_size * together, f"--batch-size {args.batch_size}")', '            pass',
     ['tests/test_training_input.py::test_a_micro_batch_that_batch_norm_cannot_normalise_is_refused_before_any_work']),
    ('src/models.py', '            if shape[0] * math.prod(shape[2:]) == 1:', '            if shape[0] == 1:',
     ['tests/test_training_input.py::test_a_micro_batch_that_batch_norm_cannot_normalise_is_refused_before_any_work']),
    ('src/cli.py', '        if not (args.freeze or args.evaluate):\n            check_batch_norm(', '        if True:\n            check_batch_norm(',
     ['tests/test_training_input.py::test_a_micro_batch_that_batch_norm_cannot_normalise_is_refused_before_any_work']),
    ('src/cli.py', 'together = int(os.environ.get("WORLD_SIZE", "1")) if distributed and args.sync_bn else 1', 'together = 1',
     ['tests/test_training_input.py::test_a_micro_batch_that_batch_norm_cannot_normalise_is_refused_before_any_work']),
    ('src/cli.py', 'together = int(os.environ.get("WORLD_SIZE", "1")) if distributed and args.sync_bn else 1', 'together = int(os.environ.get("WORLD_SIZE", "1")) if args.sync_bn else 1',
     ['tests/test_training_input.py::test_a_micro_batch_that_batch_norm_cannot_normalise_is_refused_before_any_work']),
    ('src/data_parallel.py', 'smallest = min(len(piece) for piece in torch.empty(args.batch_size).chunk(gpus))', 'smallest = args.batch_size',
     ['tests/test_training_input.py::test_a_micro_batch_that_batch_norm_cannot_normalise_is_refused_before_any_work']),
    ('src/cli.py', '        if self.ranks and os.environ.get("RANK", "0") != "0":', '        if os.environ.get("RANK", "0") != "0":',
     ['tests/test_training_input.py::test_a_launchers_variables_left_in_a_one_process_run_change_nothing']),
    ('src/stopping.py', 'launched = "TORCHELASTIC_RUN_ID" in os.environ or (dist.is_initialized() and dist.get_world_size() > 1)', 'launched = "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", 1)) > 1',
     ['tests/test_training_input.py::test_a_launchers_variables_left_in_a_one_process_run_change_nothing']),
    ('src/checkpoint.py', '"processes": dist.get_world_size() if dist.is_initialized() else 1,', '"processes": int(os.environ.get("WORLD_SIZE", 1)),',
     ['tests/test_training_input.py::test_a_launchers_variables_left_in_a_one_process_run_change_nothing']),
    ('src/outputs.py', '        check_profile_folder(args)\n', '        pass\n',
     ['tests/test_training_input.py::test_profile_writes_only_into_a_folder_of_profiles']),
    ('src/profiling.py', '    return isinstance(figures, dict) and figures.get("trace") == TRACE and isinstance(figures.get("schedule"), dict)', '    return True',
     ['tests/test_training_input.py::test_profile_writes_only_into_a_folder_of_profiles']),
    ('src/profiling.py', '    return isinstance(figures, dict) and figures.get("trace") == TRACE and isinstance(figures.get("schedule"), dict)', '    return False',
     ['tests/test_training_input.py::test_profile_writes_only_into_a_folder_of_profiles']),
    ('src/cli.py', '        check_dropout(args.arch, args.dropout)\n', '',
     ['tests/test_training_input.py::test_dropout_for_a_model_without_dropout_layers_is_refused']),
    ('src/models.py', '    if not dropout or arch not in classification_models():', '    if dropout is None or arch not in classification_models():',
     ['tests/test_training_input.py::test_dropout_for_a_model_without_dropout_layers_is_refused']),
    # --track in the scripts (issue 50): the tracked run's ids in last.pth, each epoch and step logged, its status and artifacts, accelerate's trackers.
    ('src/state.py', '            self.info = {**self.info, "tracking": ids}', '            pass',
     ['tests/test_tracking_scripts.py::test_single_stopped_and_resumed_is_one_tracked_run', 'tests/test_tracking_scripts.py::test_torchrun_stopped_resumed_and_restarted_is_one_tracked_run']),
    ('src/state.py', '            self.tracker.log_epoch(record)  # after its files', '            pass  # after its files',
     ['tests/test_tracking_scripts.py::test_single_stopped_and_resumed_is_one_tracked_run']),
    ('src/checkpoint.py', '        tracked_ids = _tracked_ids(saved)\n', '        tracked_ids = None\n',
     ['tests/test_tracking_scripts.py::test_single_stopped_and_resumed_is_one_tracked_run', 'tests/test_tracking_scripts.py::test_torchrun_stopped_resumed_and_restarted_is_one_tracked_run']),
    ('src/progress.py', '                self.state.tracker.log_step(values, optimizer_step)', '                pass',
     ['tests/test_tracking_scripts.py::test_single_stopped_and_resumed_is_one_tracked_run']),
    ('src/tracking.py', '        tracker.finish("KILLED")\n', '        tracker.finish("FINISHED")\n',
     ['tests/test_tracking_scripts.py::test_single_stopped_and_resumed_is_one_tracked_run']),
    ('src/tracking.py', '        tracker.finish("FAILED")\n', '        tracker.finish("KILLED")\n',
     ['tests/test_tracking_scripts.py::test_a_run_that_fails_ends_its_tracked_run_failed']),
    ('src/tracking.py', 'tracker.finish("FINISHED", [paths["best"], paths["info"], paths["plot"]])', 'tracker.finish("FINISHED")',
     ['tests/test_tracking_scripts.py::test_single_stopped_and_resumed_is_one_tracked_run']),
    ('src/tracking.py', 'from_rank_0(lambda: made.append(Tracker(args)))', 'from_rank_0(lambda: None)',
     ['tests/test_tracking_scripts.py::test_a_store_that_cannot_be_used_is_one_line_before_any_work']),
    ('train_accelerate.py', 'accelerator.get_tracker("tensorboard").log if args.log_dir else None)', 'accelerator.log)',
     ['tests/test_tracking_scripts.py::test_accelerate_stopped_and_resumed_is_one_tracked_run']),
    ('train_accelerate.py', 'init_kwargs=tracker.init_kwargs(state.tracked_ids, info))', 'init_kwargs=tracker.init_kwargs(None, info))',
     ['tests/test_tracking_scripts.py::test_accelerate_stopped_and_resumed_is_one_tracked_run']),
    ('train_accelerate.py', 'PROJECT if args.track else "train_accelerate"', '"train_accelerate"',
     ['tests/test_tracking_scripts.py::test_accelerate_stopped_and_resumed_is_one_tracked_run']),
    # FSDP's last as a torch.distributed.checkpoint folder (last.dcp): each rank's shards, async step checkpoints,
    # replaced whole, resumed at another number of processes and in another mode; the chaos check's world changes.
    ('train_fsdp.py', 'state.save_step(sums, write=dcp.async_save)', 'state.save_step(sums, write=dcp.save)',
     ['tests/test_scripts.py::test_fsdp_writes_last_with_torchs_distributed_checkpoint']),
    ('src/checkpoint_writer.py', 'local = self._copy_tensor(value.to_local(), where)', 'local = value.to_local()',
     ['tests/test_sharded_checkpoint.py::test_a_step_checkpoint_is_written_while_training_goes_on_and_holds_its_step']),
    ('src/sharded_checkpoint.py', '        average = {"model": {key: averaged.get(key, value) for key, value in model.items()},',
     '        average = {"model": dict(model),',
     ['tests/test_sharded_checkpoint.py::test_a_step_checkpoint_is_written_while_training_goes_on_and_holds_its_step']),
    ('src/state.py', '        broadcast_buffers(model)  # rank 0\'s batch norm statistics', '        pass  # rank 0\'s batch norm statistics',
     ['tests/test_sharded_checkpoint.py::test_a_step_checkpoint_is_written_while_training_goes_on_and_holds_its_step']),
    ('src/sharded_checkpoint.py', '        os.replace(folder, previous)', '        shutil.rmtree(folder)',
     ['tests/test_sharded_checkpoint.py::test_a_crash_between_the_renames_leaves_the_previous_folder_which_the_next_start_puts_back']),
    ('src/sharded_checkpoint.py', '            os.replace(previous, folder)', '            shutil.rmtree(previous)',
     ['tests/test_sharded_checkpoint.py::test_a_crash_between_the_renames_leaves_the_previous_folder_which_the_next_start_puts_back']),
    ('src/outputs.py', '    sharded_checkpoint.repair(sharded_checkpoint.folder_of(args))', '    pass',
     ['tests/test_sharded_checkpoint.py::test_a_kill_in_a_save_leaves_the_previous_last_dcp_and_the_restart_goes_on_from_it']),
    ('src/sharded_checkpoint.py', 'with requiring_grad(params, [f"optimizer.state.{names[id(param)]}" in held for param in params]):',
     'with requiring_grad(params, [True] * len(params)):',
     ['tests/test_fsdp.py::test_freeze_epochs_resume_into_fsdp_across_the_unfreezing']),
    ('src/sharded_checkpoint.py', '        average.updates, average.skipped = int(updates), None', '        pass',
     ['tests/test_sharded_checkpoint.py::test_two_ranks_shards_load_into_one_rank']),
    ('src/checkpoint.py', "            found.append((at, int(sharded), str(folder)))", "            found.append((at, 0, str(folder)))",
     ['tests/test_sharded_checkpoint.py::test_resume_takes_the_newer_of_last_pth_and_last_dcp']),
    ('src/checkpoint.py', "    blind = [rank for rank, seen in enumerate(gather(folder.is_dir())) if not seen]", "    blind = []",
     ['tests/test_sharded_checkpoint.py::test_every_rank_must_see_the_folder']),
    ('src/checkpoint.py', '            refuse_non_finite(list(dict.fromkeys(name for names in found for name in names)), state["from"], advice)',
     '            pass',
     ['tests/test_sharded_checkpoint.py::test_a_last_dcp_that_diverged_is_refused']),
    ('src/checkpoint.py', '    sharded_checkpoint.remove(sharded_checkpoint.folder_of(args))  # an FSDP run',
     '    pass  # an FSDP run',
     ['tests/test_sharded_checkpoint.py::test_resumed_on_one_process_with_twice_the_batch_it_ends_where_the_straight_run_does']),
    ('src/sharded_checkpoint.py', '    if replaces is not None:\n        replaces.unlink(missing_ok=True)', '',
     ['tests/test_sharded_checkpoint.py::test_a_ddp_last_pth_resumes_under_fsdp_on_one_process']),
    ('src/outputs.py', "    held += [shards] if sharded_checkpoint.whole_folder(shards) else []", "    pass",
     ['tests/test_sharded_checkpoint.py::test_a_folder_holding_a_last_dcp_holds_an_earlier_run']),
    ('src/outputs.py', '        sharded_checkpoint.remove(shards)\n', '',
     ['tests/test_sharded_checkpoint.py::test_a_folder_holding_a_last_dcp_holds_an_earlier_run']),
    # A last.dcp: nothing read runs code, every part of one save, only a save's folders replaced, a failed save
    # one line with the last checkpoint kept; its staging on the host (issues 56 and 60).
    ('src/sharded_checkpoint.py', '        if (module, name) not in METADATA_GLOBALS:', '        if False:',
     ['tests/test_sharded_checkpoint.py::test_a_crafted_metadata_runs_nothing_in_any_reader']),
    ('src/sharded_checkpoint.py', '            loaded = torch.load(value, weights_only=True)',
     '            loaded = torch.load(value, weights_only=False)',
     ['tests/test_sharded_checkpoint.py::test_a_value_in_a_shard_is_loaded_without_running_code']),
    ('src/sharded_checkpoint.py', '        dcp.load(shards, storage_reader=reader, planner=_Planner())',
     '        dcp.load(shards, checkpoint_id=folder)',
     ['tests/test_sharded_checkpoint.py::test_a_value_in_a_shard_is_loaded_without_running_code']),
    ('src/sharded_checkpoint.py', 'planner=_WholePlanner(), no_dist=True)', 'planner=_EmptyStateDictLoadPlanner(), no_dist=True)',
     ['tests/test_sharded_checkpoint.py::test_a_value_in_a_shard_is_loaded_without_running_code']),
    ('src/sharded_checkpoint.py', '        if mark != save:', '        if mark is None:',
     ['tests/test_sharded_checkpoint.py::test_a_part_of_another_save_is_refused_naming_it']),
    ('src/sharded_checkpoint.py', '    if getattr(metadata.storage_meta, "save_id", None) != save:', '    if False:',
     ['tests/test_sharded_checkpoint.py::test_a_part_of_another_save_is_refused_naming_it']),
    ('src/sharded_checkpoint.py', '        save_id = f"{self.token}-{run_step}-{self.saves}"', '        save_id = f"{run_step}-{self.saves}"',
     ['tests/test_sharded_checkpoint.py::test_a_part_of_another_save_is_refused_naming_it']),
    ('src/sharded_checkpoint.py', '        shards = {**shards, SAVE: {str(rank): save_id}}', '        shards = dict(shards)',
     ['tests/test_sharded_checkpoint.py::test_a_part_of_another_save_is_refused_naming_it']),
    ('src/sharded_checkpoint.py', '    path = Path(folder) / METADATA\n    _regular(path)\n', '    path = Path(folder) / METADATA\n',
     ['tests/test_sharded_checkpoint.py::test_a_last_dcp_without_metadata_is_one_line_and_no_library_traceback']),
    ('src/tools/report.py', 'raise UserError(f"cannot read the weights of {run.folder}: {one_line(error)}") from None',
     'raise UserError(f"cannot read the weights of {run.folder} ({type(error).__name__})") from None',
     ['tests/test_sharded_checkpoint.py::test_a_last_dcp_without_metadata_is_one_line_and_no_library_traceback']),
    ('src/outputs.py', '    sharded_checkpoint.check_ours(sharded_checkpoint.folder_of(args))', '    pass',
     ['tests/test_sharded_checkpoint.py::test_a_users_folder_at_a_saves_name_is_refused_and_left_as_it_is']),
    ('src/sharded_checkpoint.py', '        if not all(entry.is_file(follow_symlinks=False) and SAVE_FILES.fullmatch(entry.name)\n'
     '                   for entry in os.scandir(path)):', '        if False:',
     ['tests/test_sharded_checkpoint.py::test_only_the_folders_a_save_wrote_are_removed_or_renamed',
      'tests/test_sharded_checkpoint.py::test_a_users_folder_at_a_saves_name_is_refused_and_left_as_it_is']),
    ('src/sharded_checkpoint.py', '    for path in (folder, folder.parent / PREVIOUS, *temporaries(folder)):\n        _remove(path)',
     '    for path in (folder, folder.parent / PREVIOUS, *temporaries(folder)):\n        shutil.rmtree(path, ignore_errors=True)',
     ['tests/test_sharded_checkpoint.py::test_only_the_folders_a_save_wrote_are_removed_or_renamed']),
    ('src/sharded_checkpoint.py', '    if is_ours(previous):\n        if os.path.lexists(folder):',
     '    if previous.is_dir():\n        if os.path.lexists(folder):',
     ['tests/test_sharded_checkpoint.py::test_only_the_folders_a_save_wrote_are_removed_or_renamed']),
    ('src/sharded_checkpoint.py', '            raise _behind(error) from None\n\n    def finish', '            raise\n\n    def finish',
     ['tests/test_sharded_checkpoint.py::test_a_save_that_fails_on_one_rank_is_one_line_and_the_last_checkpoint_stays']),
    ('src/sharded_checkpoint.py', '        if is_first():\n            _remove(new)', '        if False:\n            _remove(new)',
     ['tests/test_sharded_checkpoint.py::test_a_full_disk_in_a_save_is_one_line_and_keeps_the_last_checkpoint',
      'tests/test_sharded_checkpoint.py::test_fsdp_on_a_full_disk_ends_in_one_line_without_a_temporary']),
    ('src/sharded_checkpoint.py', '            future.result()\n        except (Exception, CheckpointException) as error:',
     '            future.result()\n        except ZeroDivisionError as error:',
     ['tests/test_sharded_checkpoint.py::test_a_full_disk_in_a_save_is_one_line_and_keeps_the_last_checkpoint',
      'tests/test_sharded_checkpoint.py::test_fsdp_on_a_full_disk_ends_in_one_line_without_a_temporary']),
    ('src/checkpoint_writer.py', '            return DTensor(local, value._spec, requires_grad=False)',
     '            return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=value.shape, '
     'stride=value.stride())',
     ['tests/test_sharded_checkpoint.py::test_a_step_checkpoint_is_staged_on_the_host_in_buffers_kept_between_saves']),
    ('src/checkpoint_writer.py', '        pinned = tensor.is_cuda', '        pinned = False',
     ['tests/test_sharded_checkpoint.py::test_a_shard_on_a_gpu_is_staged_in_pinned_memory_and_written_after_its_copies']),
    ('src/sharded_checkpoint.py', '                self.copied.wait()  # DCP', '                pass  # DCP',
     ['tests/test_sharded_checkpoint.py::test_a_shard_on_a_gpu_is_staged_in_pinned_memory_and_written_after_its_copies']),
    ('src/sharded_checkpoint.py', '        writer = _Writer(new, folder, save_id, training, replaces, self.copies)',
     '        writer = _Writer(new, folder, save_id, training, replaces, HostCopies())',
     ['tests/test_sharded_checkpoint.py::test_a_step_checkpoint_is_staged_on_the_host_in_buffers_kept_between_saves']),
    # Rank 0 alone builds last.pth; FSDP gathers the whole model for a new best only (issue 60).
    ('src/state.py', '        if not is_first():  # the one collective the save needs is behind: rank 0 alone builds and writes '
     'last.pth\n            return\n',
     '        last = self._last_state(step=self.step, partial=partial, held=True)\n        if not is_first():\n            return\n',
     ['tests/test_checkpoint_writer.py::test_only_the_rank_that_writes_builds_last_pth']),
    ('src/state.py', '            if not is_first():  # rank 0 alone builds and writes last.pth: no collective in it\n'
     '                return False\n            last = self._last_state(model_state=model_state)\n',
     '            last = self._last_state(model_state=model_state)\n            if not is_first():\n                return False\n',
     ['tests/test_checkpoint_writer.py::test_only_the_rank_that_writes_builds_last_pth']),
    # A step checkpoint reads nothing from the device in the step: the scaler's scale and growth tracker and the
    # average's count go to the writer as Laters, copied with the tensors, made numbers after the copies (issue 60).
    ('src/state.py', 'partial=partial, held=True), output_paths(self.args)["last"])',
     'partial=partial, held=False), output_paths(self.args)["last"])', ['tests/test_checkpoint_writer.py::test_a_step_checkpoint_reads_nothing_from_the_device_in_the_training_thread']),
    ('src/state.py', '            average = {"updates": self.average.counted()} if self.average.on else None',
     '            average = {"updates": self.average.count()} if self.average.on else None', ['tests/test_sharded_checkpoint.py::test_an_fsdp_step_checkpoint_reads_nothing_from_the_device_in_the_training_thread']),
    ('src/state.py', '                                             self.info, step, partial, held=True)',
     '                                             self.info, step, partial, held=False)', ['tests/test_sharded_checkpoint.py::test_an_fsdp_step_checkpoint_reads_nothing_from_the_device_in_the_training_thread']),
    ('src/checkpoint.py', '    if not (held and scaler.is_enabled()', '    if not (False and scaler.is_enabled()', ['tests/test_checkpoint_writer.py::test_a_step_checkpoint_reads_nothing_from_the_device_in_the_training_thread', 'tests/test_sharded_checkpoint.py::test_an_fsdp_step_checkpoint_reads_nothing_from_the_device_in_the_training_thread']),
    ('src/checkpoint.py', '"_growth_tracker": Later(tracker,', '"_growth_tracker": Later(scale,', ['tests/test_checkpoint_writer.py::test_a_step_checkpoint_reads_nothing_from_the_device_in_the_training_thread', 'tests/test_sharded_checkpoint.py::test_an_fsdp_step_checkpoint_reads_nothing_from_the_device_in_the_training_thread']),
    ('src/checkpoint_writer.py', '            return Later(self._copy_tensor(value.tensor, where), value.number)',
     '            return value', ['tests/test_checkpoint_writer.py::test_a_step_checkpoint_reads_nothing_from_the_device_in_the_training_thread', 'tests/test_sharded_checkpoint.py::test_an_fsdp_step_checkpoint_reads_nothing_from_the_device_in_the_training_thread']),
    ('src/ema.py', 'lambda skipped: updates - round(skipped.item())', 'lambda skipped: self.updates - round(skipped.item())',
     ['tests/test_checkpoint_writer.py::test_a_step_checkpoint_reads_nothing_from_the_device_in_the_training_thread', 'tests/test_sharded_checkpoint.py::test_an_fsdp_step_checkpoint_reads_nothing_from_the_device_in_the_training_thread']),
    ('src/ema.py', 'average.get(id(value), value).detach()', 'value.detach()', ['tests/test_checkpoint_writer.py::test_a_step_checkpoint_reads_nothing_from_the_device_in_the_training_thread']),
    ('src/sharded_checkpoint.py', '        self.training, self.staged = staged["training"], True', '        self.staged = True',
     ['tests/test_sharded_checkpoint.py::test_an_fsdp_step_checkpoint_reads_nothing_from_the_device_in_the_training_thread']),
    ('train_fsdp.py', '                         if state.new_best(record) == "weights" else None)',
     '                         if True else None)',
     ['tests/test_fsdp.py::test_fsdp_gathers_the_whole_model_only_for_a_new_best']),
    ('src/state.py', '        return weights if best["epoch"] == record["epoch"] else None', '        return weights',
     ['tests/test_fsdp.py::test_fsdp_gathers_the_whole_model_only_for_a_new_best']),
    ('src/tools/chaos.py', 'world = rng.choice([world for world in WORLDS if world != previous])', 'world = rng.choice(WORLDS)',
     ['tests/test_chaos.py::test_each_stop_is_planned_in_the_steps_left_and_another_world']),
    ('src/tools/chaos.py', '"ends": all(min(a, b) <= limit for a, b, limit in zip(to_two, to_one, bound)),', '"ends": True,',
     ['tests/test_chaos.py::test_the_world_verdict_refuses_a_run_of_another_global_batch']),
    ('src/state.py', "        if self.tracker is not None:  # rank 0's\n",
     "        if self.tracker is not None and not is_sharded(self.optimizer):  # rank 0's\n",
     ['tests/test_tracking_scripts.py::test_fsdp_logs_each_epoch_after_its_sharded_save']),
    # The GPU path of issue 46: step checkpoints in the background, the stop agreement's read, the
    # stop bound, the heartbeat under NCCL, the proof and make test-gpu.
    ('src/checkpoint_writer.py', '        self.thread.start()', '        self.thread.start()\n        self.thread.join()',
     ['tests/test_checkpoint_writer.py::test_the_steps_after_a_save_train_while_it_is_written']),
    ('src/checkpoint_writer.py', '        buffer.copy_(tensor, non_blocking=pinned)\n        return buffer', '        return tensor',
     ['tests/test_checkpoint_writer.py::test_the_steps_after_a_save_train_while_it_is_written']),
    ('src/state.py', "            self.writer.wait()  # a step's last.pth still being written",
     '            pass  #',
     ['tests/test_checkpoint_writer.py::test_an_epochs_last_pth_is_never_replaced_by_an_older_steps_write']),
    ('src/checkpoint_writer.py', '        error, self.error = self.error, None', '        error, self.error = None, None',
     ['tests/test_checkpoint_writer.py::test_a_write_that_fails_says_so_in_the_training_thread']),
    ('src/stopping.py', '        done = waiter.query() if self.on_gpu else waiter.is_completed()', '        done = False',
     ['tests/test_stopping.py::test_the_agreement_is_read_a_check_late_without_waiting_when_it_is_done']),
    ('src/heartbeat.py', '            if not event.query():\n                return self.reached', '            if not event.query():\n                return self.place',
     ['tests/test_hung_rank.py::test_on_a_gpu_the_place_told_is_the_last_one_the_device_reached']),
    ('src/heartbeat.py', '    path = dump_flight_recorder(rank)', '    path = None',
     ['tests/test_hung_rank.py::test_a_rank_stopped_with_sigstop_is_named_within_the_timeout']),
    ('src/stopping.py', '                self.wakeup = (read, write, signal.set_wakeup_fd(write))', '                self.wakeup = (read, write, -1)',
     ['tests/test_hung_rank.py::test_a_stop_signal_is_seen_through_the_wakeup_pipe_when_the_handler_cannot_run',
      'tests/test_hung_rank.py::test_a_stop_that_no_rank_can_agree_on_ends_before_the_launchers_sigkill']),
    ('train_accelerate.py', '    with watch_ranks(joined_store(), args.dist_timeout, accelerator.device) as heartbeat',
     '    with watch_ranks(None, args.dist_timeout, accelerator.device) as heartbeat',
     ['tests/test_hung_rank.py::test_a_stop_that_no_rank_can_agree_on_ends_before_the_launchers_sigkill']),
    ('src/datasets.py', '    context.set_forkserver_preload(sorted(set(WORKER_MODULES + loaded)) + main_module())', '    context.set_forkserver_preload(sorted(set(WORKER_MODULES + loaded)))',
     ['tests/test_loaders.py::test_a_fresh_fork_server_imports_the_main_scripts_modules_once']),
    ('src/datasets.py', '    return {"multiprocessing_context": _fork_server(), ', '    return {"multiprocessing_context": multiprocessing.get_context("fork"), ',
     ['tests/test_loaders.py::test_loader_workers_started_many_times_beside_running_threads_never_hang']),
    ('src/dropout.py', '        return _scaled(grad, kept, ctx.scale), None, None',
     '        return _scaled(grad, kept, float(kept.sum()) and ctx.scale), None, None',
     ['tests/test_gpu_on_cpu_host_syncs.py::test_no_tensor_is_built_from_python_values_inside_a_step']),
    ('tests/hooks/sitecustomize.py', '    patcher.wrap("src.progress", "Progress._pass", make)', '    pass',
     ['tests/test_gpu_selftest_logic.py::test_the_sync_hook_wraps_each_training_pass_of_a_run']),
    ('src/tools/benchmark.py', '        atomic_torch_save(state, path, hashed=True)', '        atomic_torch_save(state, path)',
     ['tests/test_benchmark.py::test_save_seconds_times_the_old_save_and_the_new_one_best_of_the_rounds']),
    ('src/tools/benchmark.py', '        writer.wait()\n        best["blocked"]', '        best["blocked"]',
     ['tests/test_benchmark.py::test_save_seconds_times_the_old_save_and_the_new_one_best_of_the_rounds']),
    ('src/tools/benchmark.py', '("SGD and --ema-decay", average.state_dict())', '("SGD and --ema-decay", None)',
     ['tests/test_benchmark.py::test_the_save_cost_table_shows_each_checkpoint_and_the_floor_it_sets']),

    # Issue 45's audit: breakages a blind audit got through. The distance every agreement test
    # measures with, against an independent norm; the chaos check's verdict; a loader worker left
    # alive at exit. (The constant PrefixStore prefix is the src/process_group.py entry above, caught
    # now that the restart test checks that an attempt's store shows none of the dead one's keys.)
    ('src/tools/agreement.py', '    return total.sqrt().item()', '    return total.item()',
     ['tests/test_modes.py::test_distance_is_the_euclidean_norm_of_every_weight_difference']),
    ('src/tools/chaos.py', 'return weights == 0 and average == 0 and same_history',
     'return weights == 0 or average == 0 or same_history',
     ['tests/test_chaos.py::test_the_verdict_passes_only_the_same_weights_average_and_history']),
    ('src/datasets.py', '        if child.daemon:\n            child.kill()', '        if not child.daemon:\n            child.kill()',
     ['tests/test_reliability.py::test_image_that_turns_unreadable_during_training']),
    # A second blind audit (2026-12-05): each mixer draws lambda with its own flag's alpha when both are on.
    ('src/augment.py', 'v2.CutMix(alpha=args.cutmix_alpha,', 'v2.CutMix(alpha=args.mixup_alpha,',
     ['tests/test_augment.py::test_mixup_and_cutmix_each_mix_half_of_the_samples_with_both_alphas']),
    ('src/augment.py', 'v2.MixUp(alpha=args.mixup_alpha,', 'v2.MixUp(alpha=args.cutmix_alpha,',
     ['tests/test_augment.py::test_mixup_and_cutmix_each_mix_half_of_the_samples_with_both_alphas']),

    # survivors of a blind audit, 2026-12-05 (tools)
    ('src/tools/benchmark.py', '{sorted(later)[len(later) // 2]:.2f}', '{sorted(later)[0]:.2f}',
     ['tests/test_benchmark.py::test_the_worker_start_table_shows_the_first_pass_and_the_median_of_the_later_ones']),
    ('src/fsdp.py', 'if torch.is_tensor(value) and value.dim() > 0)}', 'if torch.is_tensor(value) and value.dim() >= 0)}',
     ['tests/test_fsdp.py::test_the_bytes_of_adamws_state_are_its_two_moments_without_the_step_counts']),
    ('src/tools/checkpoint_cost.py', 'if not pointer or pointer in self.live or pointer in inputs:',
     'if not pointer or pointer in self.live:',
     ['tests/test_sharded_checkpoint.py::test_held_bytes_counts_the_tensors_made_inside_not_older_ones_written_in_place']),
    ('src/tools/report.py', 'ok = _whole(value, 1) if key == "epoch" else', 'ok = _whole(value) if key == "epoch" else',
     ['tests/test_report_input.py::test_a_hand_edited_or_older_run_file_is_one_line_naming_the_field[epoch 0]']),
    ('src/tools/export.py', 'return any(entry.key == "format" and entry.value == FORMAT for entry in model.metadata_props)',
     'return any(entry.key == "format" for entry in model.metadata_props)',
     ['tests/test_tool_outputs.py::test_an_onnx_file_whose_format_is_another_tools_is_not_exports']),

    # survivors of a blind audit, 2026-12-05 (training)
    ('src/cli.py', 'together = int(os.environ.get("WORLD_SIZE", "1")) if distributed and args.sync_bn else 1',
     'together = int(os.environ.get("WORLD_SIZE", "1")) if distributed else 1',
     ['tests/test_training_input.py::test_a_micro_batch_that_batch_norm_cannot_normalise_is_refused_before_any_work']),
    ('src/stopping.py', 'self.requested = self.requested or signum', 'self.requested = signum',
     ['tests/test_stopping.py::test_a_second_signal_before_the_stop_is_acted_on_keeps_the_first']),
    ('src/checkpoint.py', 'step = int(state.get("step", 0)) if state["epoch"] < args.epochs else 0',
     'step = int(state.get("step", 0)) if state["epoch"] <= args.epochs else 0',
     ['tests/test_stopping.py::test_a_mid_epoch_checkpoint_past_the_epochs_asked_for_has_nothing_left_to_train']),
    ('train_ddp.py', 'batches = skip_first_batches(train_loader, state.step * args.accumulate)',
     'batches = skip_first_batches(train_loader, state.step)',
     ['tests/test_stopping.py::test_every_mode_resumes_a_mid_epoch_checkpoint_to_the_same_end[ddp]']),
    ('train_dp.py', 'batches = skip_first_batches(train_loader, state.step * args.accumulate)',
     'batches = skip_first_batches(train_loader, state.step)',
     ['tests/test_stopping.py::test_every_mode_resumes_a_mid_epoch_checkpoint_to_the_same_end[dp]']),
    ('train_fsdp.py', 'batches = skip_first_batches(train_loader, state.step * args.accumulate)',
     'batches = skip_first_batches(train_loader, state.step)',
     ['tests/test_stopping.py::test_every_mode_resumes_a_mid_epoch_checkpoint_to_the_same_end[fsdp]']),
    ('train_accelerate.py', 'batches = accelerator.skip_first_batches(train_loader, state.step * args.accumulate)',
     'batches = accelerator.skip_first_batches(train_loader, state.step)',
     ['tests/test_stopping.py::test_every_mode_resumes_a_mid_epoch_checkpoint_to_the_same_end[accelerate]']),
    # survivors of a second blind audit, 2026-12-05 (C)
    ('src/tools/checkpoint_cost.py', 'self.now -= size', 'self.now -= 0',
     ['tests/test_sharded_checkpoint.py::test_held_bytes_forgets_a_tensor_once_it_is_freed']),
    ('src/dropout.py', 'kept = drawn >= threshold if threshold', 'kept = drawn > threshold if threshold',
     ['tests/test_dropout.py::test_stochastic_depth_keeps_a_sample_drawn_exactly_at_p']),
    ('src/loaders.py', 'if len(data.train_idx) < global_batch:', 'if len(data.train_idx) <= global_batch:',
     ['tests/test_loaders.py::test_a_training_split_of_exactly_one_global_batch_is_accepted_and_one_fewer_refused']),
    ('src/tools/report.py', 'if not 0 <= p_dog <= 1:', 'if not 0 < p_dog <= 1:',
     ['tests/test_report_input.py::test_predictions_of_exactly_0_and_1_are_read_and_outside_them_refused']),

    # survivors of a second blind audit, 2026-12-05 (D)
    ('src/errors.py', 'end_process_group()  # after an error', 'pass  # after an error',
     ['tests/test_in_process.py::test_a_command_that_fails_on_bad_input_ends_the_process_group_it_started']),
    ('src/tools/predict.py', 'if k + 1 < len(chunks):', 'if k + 1 < len(chunks) - 1:',
     ['tests/test_export.py::test_predict_onnx_in_several_batches_predicts_every_image']),
    ('src/progress.py', 'every = self.args.log_every * accumulate', 'every = self.args.log_every',
     ['tests/test_watch.py::test_log_every_counts_optimizer_steps_not_micro_batches']),
    ('src/fsdp.py', 'for param, flag in zip(params, trains):', 'for param, flag in zip(params, flags):',
     ['tests/test_sharded_checkpoint.py::test_loading_a_last_dcp_leaves_each_parameter_frozen_or_trained_as_it_was']),
    # A rank's error: its loader workers ended through their queues before the garbage collection.
    ('src/errors.py', '        end_loader_workers()\n        gc.collect()', '        gc.collect()',
     ['tests/test_reliability.py::test_an_error_ends_the_loader_workers_through_their_queues_before_the_process_group']),
    ('src/errors.py', 'if issubclass(type(found), _MultiProcessingDataLoaderIter)', 'if isinstance(found, _MultiProcessingDataLoaderIter)',
     ['tests/test_reliability.py::test_ending_the_loader_workers_passes_over_objects_that_cannot_say_their_class']),
    # A fourth blind audit's survivors.
    ('src/outputs.py', 'return [folder / name for name in names if name.startswith(prefix) and name.endswith(".tmp")]',
     'return [folder / name for name in names if name.startswith(prefix)]',
     ['tests/test_tool_outputs.py::test_temporary_names_fit_and_are_found_by_name_not_by_pattern']),
    ('src/process_group.py', 'differ = [key for key in keys if any(flags.get(key) != everyone[0].get(key) for flags in everyone)]',
     'differ = [key for key in keys if all(flags.get(key) != everyone[0].get(key) for flags in everyone[1:])]',
     ['tests/test_ranks_agree.py::test_one_rank_of_three_with_another_flag_is_named']),
    ('src/tools/predict.py', 'workers = default_workers() if args.workers is None else args.workers',
     'workers = default_workers()', ['tests/test_predict.py::test_tta_amp_and_channels_last_are_applied']),
    ('src/fsdp.py', 'return {key: value.clone() if value.untyped_storage().data_ptr() in live else value',
     'return {key: value if value.untyped_storage().data_ptr() in live else value',
     ['tests/test_fsdp.py::test_the_whole_model_is_a_copy_that_the_next_step_leaves_as_it_was']),
    # A third blind audit's survivors, each caught now.
    ('src/image_files.py', 'int(part) if part.isdecimal() else part.lower()', 'int(part) if part.isdecimal() else part',
     ['tests/test_datasets.py::test_natural_order']),
    ('src/stopping.py', 'arguments = [argument for argument in command if argument != "--overwrite"]',
     'arguments = [argument for argument in command if argument != "--resume"]',
     ['tests/test_stopping.py::test_the_command_to_go_on_has_resume_in_place_of_overwrite']),
    ('src/state.py', 'and self.step < self.steps_per_epoch', 'and self.step <= self.steps_per_epoch',
     ['tests/test_stopping.py::test_a_step_checkpoint_is_due_every_n_steps_of_the_run_but_never_at_an_epochs_last_step']),
    ('src/state.py', 'train_seconds=earlier + train_seconds', 'train_seconds=train_seconds',
     ['tests/test_stopping.py::test_a_resumed_epochs_record_counts_the_seconds_trained_before_the_stop']),
    ('src/datasets.py', 'label = _label_of(Path(name)) if Path(name).suffix.lower() in IMAGE_SUFFIXES else None',
     'label = _label_of(Path(name)) if Path(name).suffix in IMAGE_SUFFIXES else None',
     ['tests/test_datasets.py::test_an_upper_case_suffix_is_an_image_like_its_lower_case_one']),
    ('src/process_group.py', '        if rank != before + 1:', '        if rank != before:',
     ['tests/test_ranks_agree.py::test_the_ranks_that_gave_a_value_are_named_in_spans']),
    ('src/tools/report.py', '"val_fraction": (lambda v: v is None or (_finite(v) and 0 < v < 1),',
     '"val_fraction": (lambda v: v is None or (_finite(v) and 0 <= v < 1),',
     ['tests/test_report_input.py::test_a_hand_edited_or_older_run_file_is_one_line_naming_the_field']),
    ('src/checkpoint_writer.py', 'if (buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype',
     'if (buffer is None or buffer.shape != tensor.shape',
     ['tests/test_checkpoint_writer.py::test_a_tensor_saved_again_in_another_dtype_is_written_in_its_new_dtype']),
    ('src/progress.py', 'values["images_per_s"] = (index - before_index) * self.batch_images / (at - before_at)',
     'values["images_per_s"] = (index - before_index) / (at - before_at)',
     ['tests/test_watch.py::test_images_per_second_are_the_images_since_the_last_report_over_its_seconds']),
    # The stop agreement of a signal that reaches one rank (a blind audit's survivor), on two ranks in one process.
    ('src/stopping.py', 'work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True)',
     'work = dist.all_reduce(tensor, op=dist.ReduceOp.MIN, async_op=True)',
     ['tests/test_stopping.py::test_a_signal_to_one_rank_early_in_a_long_epoch_stops_every_rank_within_two_checks']),
    ('src/stopping.py', 'dist.all_reduce(tensor, op=dist.ReduceOp.MAX)\n', 'dist.all_reduce(tensor, op=dist.ReduceOp.MIN)\n',
     ['tests/test_stopping.py::test_a_signal_to_one_rank_early_in_a_long_epoch_stops_every_rank_within_two_checks']),
    # Which rank says a refusal that every rank finds: caught only some of the time by the launches (a race).
    ('src/process_group.py', 'f"same flags ({differ} may differ per node)", quiet=not is_first())',
     'f"same flags ({differ} may differ per node)", quiet=is_first())',
     ['tests/test_ranks_agree.py::test_rank_0_alone_says_a_refusal_that_every_rank_finds_and_the_others_end_quietly']),
    ('src/loaders.py', '"use fewer processes or more data", quiet=not is_first())',
     '"use fewer processes or more data", quiet=is_first())',
     ['tests/test_ranks_agree.py::test_rank_0_alone_says_a_refusal_that_every_rank_finds_and_the_others_end_quietly']),
    ('src/loaders.py', 'quiet=not is_first())  # every rank finds it: rank 0 says it',
     'quiet=False)  # every rank finds it: rank 0 says it',
     ['tests/test_ranks_agree.py::test_rank_0_alone_says_a_refusal_that_every_rank_finds_and_the_others_end_quietly']),
    # Every number a flag takes bounded when parsed; a flag that cannot act refused; predict's ranks agree.
    ('src/tools/synthetic.py', 'type=between(16, IMAGE_SIZES[1])', 'type=int',
     ['tests/test_flag_bounds.py::test_every_number_a_flag_takes_is_bounded_when_parsed[src.tools.synthetic]',
      'tests/test_flag_bounds.py::test_a_number_past_its_bound_is_one_line_before_any_work']),
    ('src/cli.py', '        if value > maximum:\n            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")',
     '        if False:\n            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")',
     ['tests/test_flag_bounds.py::test_every_number_a_flag_takes_is_bounded_when_parsed[train_single]']),
    ('src/cli.py', 'type=ranged(0, DIST_TIMEOUT_MINUTES, True, False)', 'type=positive',
     ['tests/test_flag_bounds.py::test_a_number_past_its_bound_is_one_line_before_any_work']),
    ('src/cli.py', 'add("--seed", type=between(*SEEDS)', 'add("--seed", type=int',
     ['tests/test_flag_bounds.py::test_every_number_a_flag_takes_is_bounded_when_parsed[train_single]']),
    ('src/tools/checkpoint_cost.py', 'parser.add_argument("--ema-decay", type=open_fraction,', 'parser.add_argument("--ema-decay", type=float,',
     ['tests/test_flag_bounds.py::test_every_number_a_flag_takes_is_bounded_when_parsed[src.tools.checkpoint_cost]']),
    ('src/cli.py', 'if value is not unset and value is not None}', 'if value is not None}',
     ['tests/test_flag_bounds.py::test_a_flag_that_cannot_act_is_refused_even_at_its_default']),
    ('src/cli.py', 'parser.refuse_unless(given, flag, args.auto_augment == policy,', 'parser.refuse_unless(given, flag, True,',
     ['tests/test_flag_bounds.py::test_a_flag_that_cannot_act_is_refused_even_at_its_default']),
    ('src/cli.py', 'parser.refuse_unless(given, "momentum", args.optimizer == "sgd",', 'parser.refuse_unless(given, "momentum", True,',
     ['tests/test_flag_bounds.py::test_a_flag_that_cannot_act_is_refused_even_at_its_default']),
    ('src/cli.py', '    if args.sync_bn and Path(name).stem == "train_single":', '    if False:',
     ['tests/test_flag_bounds.py::test_a_flag_that_cannot_act_is_refused_even_at_its_default']),
    ('src/cli.py', '"track", "save_every_steps"):', '"track"):',
     ['tests/test_flag_bounds.py::test_a_flag_that_cannot_act_is_refused_even_at_its_default']),
    ('src/models.py', 'if sync_bn and arch in classification_models() and not has_batch_norm(arch):', 'if False:',
     ['tests/test_flag_bounds.py::test_sync_bn_of_a_model_without_batch_norm_is_refused']),
    ('src/tools/benchmark.py', '        args.modes = ",".join(name for name in args.modes.split(",") if name != "ddp-sync-bn")\n', '',
     ['tests/test_flag_bounds.py::test_sync_bn_of_a_model_without_batch_norm_is_refused']),
    ('src/tools/predict.py', 'parser.refuse_unless(given, "data_dir", not args.paths,',
     'parser.refuse_unless(given, "data_dir", True,',
     ['tests/test_flag_bounds.py::test_tools_refuse_a_flag_that_cannot_act']),
    ('src/tools/prepare.py', 'parser.refuse_unless(parser.given(argv), "image_size", args.cache is not None,',
     'parser.refuse_unless(parser.given(argv), "image_size", True,',
     ['tests/test_flag_bounds.py::test_tools_refuse_a_flag_that_cannot_act']),
    ('src/tools/predict.py', '                check_ranks_agree(args)\n', '',
     ['tests/test_ranks_agree.py::test_predicts_ranks_agree_on_flags_and_on_the_checkpoints_content']),
    ('src/tools/predict.py', '"checkpoint": checkpoint_of(args)}, ("checkpoint",)),', '"checkpoint": checkpoint_of(args)}, ()),',
     ['tests/test_ranks_agree.py::test_predicts_ranks_agree_on_flags_and_on_the_checkpoints_content']),
    ('src/process_group.py', '    for key in files:\n', '    for key in ("weights",):\n',
     ['tests/test_ranks_agree.py::test_predicts_ranks_agree_on_flags_and_on_the_checkpoints_content']),
    # Trackers: a store that cannot keep the run, the database's own reason, no library output,
    # the training thread never waiting for a store, a bounded end; outputs never in the data folder;
    # a named pipe never opened; a last.pth given for a best.pth; Pillow's warnings once per command.
    ('src/tracking.py', '            return one_line(orig)', '            return one_line(cause)',
     ['tests/test_tracking.py::test_the_reason_of_a_store_is_the_databases_own_words']),
    ('src/tracking.py', "return f\"no MLflow store takes its scheme; MLflow takes {', '.join(schemes)}\"", 'return str(cause)',
     ['tests/test_tracking.py::test_the_reason_of_a_store_is_the_databases_own_words']),
    ('src/tracking.py', '    if scheme.split("+")[0] == "sqlite" and sqlite_file(uri) is None:', '    if False:',
     ['tests/test_tracking.py::test_a_store_that_cannot_keep_the_run_is_refused_when_parsed']),
    ('src/cli.py', '    if uri is None and "mlflow" in (track or []) and variable and uri_problem(variable):', '    if False:',
     ['tests/test_tracking.py::test_a_store_that_cannot_keep_the_run_is_refused_when_parsed']),
    ('src/tracking.py', '    if head != SQLITE_HEADER:', '    if False:',
     ['tests/test_tracking.py::test_a_file_that_is_not_an_mlflow_store_is_refused_and_left_as_it_was']),
    ('src/tracking.py', '    if not set(MLFLOW_TABLES) <= tables:', '    if False:',
     ['tests/test_tracking.py::test_a_file_that_is_not_an_mlflow_store_is_refused_and_left_as_it_was']),
    ('src/tools/benchmark.py', '        parser.error(f"argument --{runs[1].replace', '        print(f"argument --{runs[1].replace',
     ['tests/test_benchmark.py::test_a_flag_the_chosen_benchmark_does_not_read_is_refused']),
    ('src/tools/benchmark.py', 'parser.refuse_unless(given, flag, flag in ONLY_RUNS[runs[0]],', 'parser.refuse_unless(given, flag, True,',
     ['tests/test_benchmark.py::test_a_flag_the_chosen_benchmark_does_not_read_is_refused']),
    ('src/tools/benchmark.py', 'parser.refuse_unless(given, flag, flag not in REFERENCE_ONLY,', 'parser.refuse_unless(given, flag, True,',
     ['tests/test_benchmark.py::test_a_flag_the_chosen_benchmark_does_not_read_is_refused']),
    ('src/tools/benchmark.py', '    "reference": {"data_dir", "images", "out_dir", "arch", "image_size", "batch_size", "workers", "epochs", "rounds"},',
     '    "reference": {"data_dir", "images", "out_dir", "arch", "image_size", "batch_size", "workers", "epochs"},',
     ['tests/test_benchmark.py::test_the_reference_runs_train_single_and_the_plain_loop_on_the_same_images']),
    ('src/ray_worker.py', '            end_group_after_the_note()  # the others', '            end_process_group()  # the others',
     ['tests/test_ray.py::test_a_save_that_failed_on_rank_0_ends_every_worker_before_rays_report']),
    ('src/ray_worker.py', '            mark_ended()\n            end_process_group()\n', '            end_process_group()\n',
     ['tests/test_ray.py::test_a_save_that_failed_on_rank_0_ends_every_worker_before_rays_report']),
    ('src/ray_worker.py', '        mark_ended()  # the note is read', '        pass  # the note is read',
     ['tests/test_ray.py::test_a_save_that_failed_on_rank_0_ends_every_worker_before_rays_report']),
    ('train_ray.py', 'except Exception:  # not installed (ImportError)', 'except ImportError:  # not installed (ImportError)',
     ['tests/test_ray.py::test_a_ray_that_fails_as_it_imports_is_one_line']),
    ('src/ray_driver.py', '            importlib.import_module("ray.train.torch")\n', '            pass\n',
     ['tests/test_ray.py::test_a_ray_that_fails_as_it_imports_is_one_line']),
    ('src/tools/prepare.py', '    val = None if val_dir is None else load_val_labels(val_dir, data_dir, frame, show_progress)\n'
     '    atomic_write_text(data_dir / "train.csv", csv_text(["filename", "label"], frame.itertuples(index=False)))\n',
     '    atomic_write_text(data_dir / "train.csv", csv_text(["filename", "label"], frame.itertuples(index=False)))\n'
     '    val = None if val_dir is None else load_val_labels(val_dir, data_dir, frame, show_progress)\n',
     ['tests/test_val_dir.py::test_prepare_refuses_a_val_dir_of_training_images_before_it_writes_train_csv']),
    ('src/tracking.py', '?mode=rw", uri=True, timeout=CHECK_SECONDS)', '?mode=ro", uri=True, timeout=CHECK_SECONDS)',
     ['tests/test_tracking.py::test_a_store_whose_writer_was_killed_in_a_transaction_is_rolled_back_and_tracked_into']),
    ('src/tracking.py', '        self.sender.metrics([Metric(key, value, now, step) for key, value in values.items()])',
     '        self._send([Metric(key, value, now, step) for key, value in values.items()])',
     ['tests/test_tracking.py::test_the_training_thread_never_waits_for_the_store']),
    ('src/tracking.py', 'and len(job) + len(self.jobs[0][0]) <= self.BATCH:', 'and False:',
     ['tests/test_tracking.py::test_the_training_thread_never_waits_for_the_store']),
    ('src/tracking.py', '            self.environment = _set_environment(RUN_REQUEST, override=False)', '            pass',
     ['tests/test_tracking.py::test_the_training_thread_never_waits_for_the_store']),
    ('src/tracking.py', '            self.levels = _quiet_libraries()', '            pass',
     ['tests/test_tracking.py::test_a_store_failing_during_the_run_is_our_one_line_and_no_library_output']),
    ('src/tracking.py', '            _loud_again(self.levels)\n            self.environment, self.levels = {}, {}',
     '            self.environment, self.levels = {}, {}',
     ['tests/test_tracking.py::test_a_store_failing_during_the_run_is_our_one_line_and_no_library_output']),
    ('src/tracking.py', 'error = done.exception(timeout=END_SECONDS if failed else None)', 'error = done.exception(timeout=None)',
     ['tests/test_tracking.py::test_the_end_of_a_run_whose_store_failed_is_given_up_after_end_seconds']),
    ('src/tracking.py', '    if os.path.islink(folder):', '    if False:',
     ['tests/test_tracking.py::test_a_trackers_folder_that_is_a_link_is_refused']),
    ('src/outputs.py', '    for flag, path in [*files, *folders, *others]:  # one rule for every output: none in a folder it reads',
     '    for flag, path in files:',
     ['tests/test_outputs.py::test_training_refuses_an_output_that_is_an_input_or_another_output']),
    ('src/outputs.py', '                  others=store_outputs(args))', '                  others=[])',
     ['tests/test_outputs.py::test_training_refuses_an_output_that_is_an_input_or_another_output']),
    ('src/image_files.py', '    if problem is not None and not broken_link(Path(path)):', '    if False:',
     ['tests/test_inputs.py::test_a_named_pipe_is_named_for_what_it_is_and_never_opened']),
    ('src/image_files.py', '            raise UserError(f"{path}: {input_problem(path, folder=True)}")',
     '            raise UserError(f"{path}: no such file or folder")',
     ['tests/test_inputs.py::test_a_named_pipe_is_named_for_what_it_is_and_never_opened']),
    ('src/datasets.py', '        if input_problem(train_dir / name) is not None:  # not opened: a named pipe would wait for a writer',
     '        if False:', ['tests/test_inputs.py::test_a_named_pipe_is_named_for_what_it_is_and_never_opened']),
    ('src/datasets.py', '    if os.path.lexists(csv_file) and input_problem(csv_file):', '    if False:',
     ['tests/test_inputs.py::test_a_named_pipe_is_named_for_what_it_is_and_never_opened']),
    ('src/models.py', '    problem = input_problem(path)\n    if problem is not None:\n        raise UserError(f"{flag} {path}: {problem} (use',
     '    problem = None if path.exists() else "no such file"\n    if problem is not None:\n        raise UserError(f"{flag} {path}: {problem} (use',
     ['tests/test_inputs.py::test_a_named_pipe_is_named_for_what_it_is_and_never_opened']),
    ('src/inference.py', '    if os.path.lexists(info_path) and input_problem(info_path) is not None:', '    if False:',
     ['tests/test_inputs.py::test_a_named_pipe_is_named_for_what_it_is_and_never_opened']),
    ('src/inference.py', '        if training_checkpoint(checkpoint):', '        if False:',
     ['tests/test_inputs.py::test_predict_and_export_given_a_last_pth_say_it_is_a_training_checkpoint']),
    ('src/inference.py', '    return isinstance(state, dict) and {"model", "optimizer", "history"} <= set(state)',
     '    return isinstance(state, dict)',
     ['tests/test_inputs.py::test_predict_and_export_given_a_last_pth_say_it_is_a_training_checkpoint']),
    ('src/errors.py', '            ignore_pillow_warnings()\n            main(argv)', '            main(argv)',
     ['tests/test_every_image.py::test_pillows_warnings_about_an_odd_image_are_not_printed[0]']),
    ('src/datasets.py', '    ignore_stop_signals()\n    ignore_pillow_warnings()\n', '    ignore_stop_signals()\n',
     ['tests/test_every_image.py::test_pillows_warnings_about_an_odd_image_are_not_printed[1]']),
    ('src/datasets.py', "    try:  # Pillow's warnings about odd EXIF data: src.errors.ignore_pillow_warnings\n        image = Image.open(path)",
     '    try:\n        warnings.filterwarnings("ignore", module="PIL")\n        image = Image.open(path)',
     ['tests/test_fsdp.py::test_a_torch_warning_of_every_step_is_printed_once_per_run']),
    ('src/tools/predict.py', 'parser.refuse_unless(given, "overwrite", str(args.output) != "-",',
     'parser.refuse_unless(given, "overwrite", True,', ['tests/test_flag_bounds.py::test_tools_refuse_a_flag_that_cannot_act']),
    ('src/tools/benchmark.py', 'parser.refuse_unless(given, "images", args.data_dir is None,',
     'parser.refuse_unless(given, "images", True,', ['tests/test_flag_bounds.py::test_tools_refuse_a_flag_that_cannot_act']),
    ('src/tools/chaos.py', 'parser.refuse_unless(parser.given(argv), flag, args.change_world,',
     'parser.refuse_unless(parser.given(argv), flag, True,', ['tests/test_flag_bounds.py::test_tools_refuse_a_flag_that_cannot_act']),
    # Your own photos: class folders at any depth, --val-dir (tests/test_val_dir.py), the layouts named.
    ('src/datasets.py', '    if len(relative.parts) >= 2:', '    if len(relative.parts) == 2:',
     ['tests/test_datasets.py::test_images_at_any_depth_under_a_class_folder_are_labelled_by_it',
      'tests/test_val_dir.py::test_the_val_dir_is_the_validation_set_and_every_train_image_trains']),
    ('src/datasets.py', '    return text + (f", or a {shown(csv_file)} of filename,label (0/cat, 1/dog) naming files in it" if csv_file else "")',
     '    return text',
     ['tests/test_datasets.py::test_no_labelled_images_names_every_layout_it_takes']),
    ('src/loaders.py', '    val_dir = args.val_dir\n',
     '    val_dir = None\n',
     ['tests/test_val_dir.py::test_the_val_dir_is_the_validation_set_and_every_train_image_trains',
      'tests/test_val_dir.py::test_every_rank_and_the_cache_see_the_same_validation_images']),
    ('src/cli.py', '    if args.val_dir is not None and "val_fraction" in given:', '    if False:',
     ['tests/test_val_dir.py::test_val_dir_refuses_val_fraction_and_an_image_it_trains_on']),
    ('src/checkpoint.py', '"data": data, "val_data": val_data,', '"data": data, "val_data": None,',
     ['tests/test_val_dir.py::test_resume_refuses_another_val_dir_or_none']),
    # train.csv's repeated rows by the file they name, however spelled
    ('src/datasets.py', '        file = os.path.realpath(Path(root_dir) / name)', '        file = name',
     ['tests/test_datasets.py::test_bad_csv_is_a_clear_error']),
    # linked folders followed, each real folder once
    ('src/image_files.py', '            if is_folder:', '            if is_folder and not entry.is_symlink():',
     ['tests/test_datasets.py::test_a_linked_folder_is_followed_as_imagefolder_follows_it_each_real_folder_once']),
    ('src/inference.py', '        for key in ("arch", "num_classes", "image_size", "seed", "val_fraction", "data", "val_data"):',
     '        for key in ("arch", "num_classes", "image_size", "seed", "val_fraction", "data"):',
     ['tests/test_val_dir.py::test_evaluate_and_the_report_validate_on_the_val_dir']),
    ('src/ray_driver.py', ' or not is_host_name(host) or ', ' or ', ['tests/test_ray.py::test_an_address_where_no_cluster_answers_is_one_line']),
    ('src/ray_driver.py', 'port.isascii() and port.isdigit() and 0 < int(port) < 2**16', 'port.isdigit()', ['tests/test_ray.py::test_an_address_where_no_cluster_answers_is_one_line']),
    # each end of a ranged flag
    ('src/cli.py', '    add("--label-smoothing", type=_fraction(False, True)', '    add("--label-smoothing", type=_fraction(False, False)', ['tests/test_flag_bounds.py::test_each_end_of_a_range_is_taken_or_refused_as_stated']),
    ('src/cli.py', '    add("--ema-decay", type=open_fraction', '    add("--ema-decay", type=_fraction(True, False)', ['tests/test_flag_bounds.py::test_each_end_of_a_range_is_taken_or_refused_as_stated']),
    ('src/cli.py', '    add("--random-erase", metavar="P", type=_fraction(False, False)', '    add("--random-erase", metavar="P", type=_fraction(False, True)', ['tests/test_flag_bounds.py::test_each_end_of_a_range_is_taken_or_refused_as_stated']),
    ('src/cli.py', 'type=ranged(0, DIST_TIMEOUT_MINUTES, True, False)', 'type=ranged(0, DIST_TIMEOUT_MINUTES, True, True)', ['tests/test_flag_bounds.py::test_each_end_of_a_range_is_taken_or_refused_as_stated']),
    # the schedule's boundaries
    ('src/recipe.py', '(progress >= 0.75)', '(progress > 0.75)', ['tests/test_recipe.py::test_lr_factor_shapes']),
    ('src/recipe.py', 'round(args.warmup_epochs * steps)', 'int(args.warmup_epochs * steps)',
     ['tests/test_recipe.py::test_a_fractional_warm_up_lasts_its_nearest_whole_count_of_steps']),
    ('src/checkpoint.py', '(("epochs",) if args.lr_schedule != "constant" else ())', '(("epochs",) if args.lr_schedule == "cosine" else ())',
     ['tests/test_resume_rules.py::test_a_schedule_that_spans_the_run_keeps_its_epochs']),
    # launcher variables as no launcher sets them
    ('src/process_group.py', '        if not (text.isascii() and text.isdigit()):', '        if False:', ['tests/test_outputs.py::test_launcher_variables_no_launcher_sets_are_one_line']),
    ('src/process_group.py', ' and 0 < numbers["MASTER_PORT"] < 2**16)', ')', ['tests/test_outputs.py::test_launcher_variables_no_launcher_sets_are_one_line']),
    # an output folder at an input file's name; test/; prepare's --cache
    ('src/outputs.py', '        if (flag, path) in others:\n            continue', '        if (flag, path) in [*folders, *others]:\n            continue', ['tests/test_outputs.py::test_an_output_folder_never_takes_an_input_files_name_or_lands_in_test']),
    ('src/outputs.py', ', ("--data-dir\'s test/", data / "test")]', ']', ['tests/test_outputs.py::test_an_output_folder_never_takes_an_input_files_name_or_lands_in_test']),
    ('src/tools/prepare.py', '    if args.cache is not None:  # where the cache goes', '    if False:  # where the cache goes', ['tests/test_outputs.py::test_an_output_folder_never_takes_an_input_files_name_or_lands_in_test']),
    ('src/inference.py', '    if info_path == Path(checkpoint):  # best.json itself given', '    if False:  # best.json itself given',
     ['tests/test_inputs.py::test_predict_and_export_given_a_last_pth_say_it_is_a_training_checkpoint']),
    ('src/metrics.py', '    logits = logits.detach().float()', '    logits = logits.float()',
     ['tests/test_augment.py::test_batch_sums_of_soft_targets_count_the_dominant_label']),
    # --val-dir's overlap by content, not by path
    ('src/datasets.py', '    if both:', '    if len(both) > 1:',
     ['tests/test_val_dir.py::test_val_dir_refuses_a_hard_link_or_a_copy_of_a_training_image_and_keeps_an_equal_sized_other']),
    ('src/datasets.py', 'any(digest(other) == digest(file) for other in candidates)',
     'any(os.path.realpath(other) == os.path.realpath(file) for other in candidates)',
     ['tests/test_val_dir.py::test_val_dir_refuses_a_hard_link_or_a_copy_of_a_training_image_and_keeps_an_equal_sized_other']),
    ('src/datasets.py', 'any(digest(other) == digest(file) for other in candidates)', 'any(True for other in candidates)',
     ['tests/test_val_dir.py::test_val_dir_refuses_a_hard_link_or_a_copy_of_a_training_image_and_keeps_an_equal_sized_other']),
    ('src/datasets.py', '        if (length := size(other)) is not None:', '        if False:',
     ['tests/test_val_dir.py::test_val_dir_refuses_a_hard_link_or_a_copy_of_a_training_image_and_keeps_an_equal_sized_other']),
    ('src/datasets.py', '    if both:', '    if False:',
     ['tests/test_val_dir.py::test_val_dir_refuses_val_fraction_and_an_image_it_trains_on']),
    ('src/tools/report.py', '        val_dir = val_dir if val_dir is not None else Path(info["flags"]["val_dir"])', '        val_dir = None',
     ['tests/test_val_dir.py::test_evaluate_and_the_report_validate_on_the_val_dir']),
    ('src/tools/prepare.py', '        dataset = labelled_images(args.data_dir, args.image_size, True, table, val)',
     '        dataset = labelled_images(args.data_dir, args.image_size)',
     ['tests/test_val_dir.py::test_every_rank_and_the_cache_see_the_same_validation_images']),
    # The guards a diff shows are marked as such (tests/test_scripts.py).
    ('train_ddp.py', "    check_same_flags(args)  # guard: every rank launched", "    check_same_flags(args)  # every rank launched",
     ['tests/test_scripts.py::test_every_guard_in_a_diff_is_marked_as_one']),
    ('train_ray.py', "  # guard: this worker's GPU", "  # this worker's GPU",
     ['tests/test_scripts.py::test_every_guard_in_a_diff_is_marked_as_one']),
    ('train_fsdp.py', "  # guard: each validation image on one rank, once", "  # each validation image on one rank, once",
     ['tests/test_scripts.py::test_every_guard_in_a_diff_is_marked_as_one']),
    # A training-only install (requirements.txt; the trackers in requirements-track.txt).
    ('src/cli.py', 'TRACKERS_FILE = "requirements-track.txt"', 'TRACKERS_FILE = "requirements.txt"',
     ['tests/test_tracking.py::test_a_tracker_not_installed_is_refused_when_parsed',
      'tests/test_repository.py::test_training_predict_and_the_report_need_only_requirements_txt']),
    ('src/tracking.py', 'import contextlib\n', 'import contextlib\n\nimport mlflow  # noqa: F401\n',
     ['tests/test_repository.py::test_training_predict_and_the_report_need_only_requirements_txt']),
    ('Makefile', 'demo: $(VENV)/.train-installed $(SYNTHETIC)/train', 'demo: $(VENV)/.installed $(SYNTHETIC)/train',
     ['tests/test_repository.py::test_make_demo_installs_training_alone_and_make_test_everything']),
    # docs/slurm/train.sbatch: a port per job, the GPUs from Slurm, the code and venv named (tests/test_slurm.py).
    ('docs/slurm/train.sbatch', 'PORT=${RDZV_PORT:-$((10000 + SLURM_JOB_ID % 20000))}', 'PORT=${RDZV_PORT:-29500}',
     ['tests/test_slurm.py::test_two_jobs_on_one_head_node_get_different_ports']),
    ('docs/slurm/train.sbatch', 'if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then', 'if false; then',
     ['tests/test_slurm.py::test_a_port_in_use_on_the_head_node_is_refused_before_srun']),
    ('docs/slurm/train.sbatch', 'GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE##*:}}', 'GPUS_PER_NODE=${GPUS_PER_NODE:-4}',
     ['tests/test_slurm.py::test_the_processes_per_node_are_the_gpus_slurm_allocated']),
    ('docs/slurm/train.sbatch', 'if ! [[ "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]]; then', 'if false; then',
     ['tests/test_slurm.py::test_a_job_without_gpus_or_without_the_code_and_venv_stops_before_srun']),
    ('docs/slurm/train.sbatch', 'srun --kill-on-bad-exit=1 "$VENV/bin/torchrun"', 'srun --kill-on-bad-exit=1 torchrun',
     ['tests/test_slurm.py::test_one_torchrun_per_node_with_a_rendezvous_on_the_first_node']),
    ('docs/slurm/train.sbatch', 'if [ ! -f "$CODE/train_ddp.py" ] || [ ! -x "$VENV/bin/torchrun" ]; then', 'if false; then',
     ['tests/test_slurm.py::test_a_job_without_gpus_or_without_the_code_and_venv_stops_before_srun']),
    # docs/flags.md against every script's --help; predict's --help.
    ('src/cli.py', '    if amp:', '    if True:',
     ['tests/test_flags.py::test_the_flag_page_lists_each_scripts_flags_and_defaults']),
    ('src/cli.py', 'add("--log-every", type=between(*STEPS), default=10,', 'add("--log-every", type=between(*STEPS), default=20,',
     ['tests/test_flags.py::test_the_flag_page_lists_each_scripts_flags_and_defaults']),
    ('src/tools/predict.py', 'formatter_class=DefaultsHelp)', ')',
     ['tests/test_predict.py::test_help_gives_every_option_a_text_and_its_default']),
    # A run removes or renames a folder at a save's name only if a save wrote it: its training.pt
    # loads as a save's (an empty folder of the user's, or one holding a text training.pt, is not).
    ('src/sharded_checkpoint.py', "        return bool(TEMPORARY.fullmatch(path.name)) or _holds_a_saves_training(path)",
     "        return True",
     ['tests/test_sharded_checkpoint.py::test_a_users_folder_holding_only_a_saves_names_is_not_taken_for_a_save']),
    ('src/sharded_checkpoint.py', '    return isinstance(training, dict) and "epoch" in training', '    return True',
     ['tests/test_sharded_checkpoint.py::test_a_users_folder_holding_only_a_saves_names_is_not_taken_for_a_save']),
    # predict's ranks compare its checkpoint by content: a named pipe is named, never opened.
    ('src/process_group.py', '            if problem is not None:\n                flags[key]',
     '            if False:\n                flags[key]',
     ['tests/test_ranks_agree.py::test_a_named_pipe_compared_by_content_is_named_not_opened']),
    # The flags' floats are what a float32 holds.
    ('src/cli.py', '    if abs(value) > FLOAT32_MAX:', '    if False:',
     ['tests/test_flag_bounds.py::test_a_number_past_its_bound_is_one_line_before_any_work']),
    ('src/cli.py', '    if value != 0 and abs(value) < FLOAT32_TINY:', '    if False:',
     ['tests/test_flag_bounds.py::test_a_number_past_its_bound_is_one_line_before_any_work']),
    # Issue 60's step on the CPU: the loader workers' fork server started in the first data call.
    ('src/loaders.py', '        start_worker_server()', '        pass',
     ['tests/test_loaders.py::test_labelled_data_starts_the_workers_server_before_the_model_when_there_are_workers']),
    # Issue 60: the normalisation in place.
    ('src/transforms.py', '    return images.to(torch.float32, copy=True).div_(255).sub_(mean_t).div_(std_t)',
     '    return images.float().div_(255).sub_(mean_t).div_(std_t)',
     ['tests/test_performance.py::test_normalize_in_place_gives_the_formulas_values_and_leaves_its_input']),
    ('src/transforms.py', '    return images.to(torch.float32, copy=True).div_(255).sub_(mean_t).div_(std_t)',
     '    return images.to(torch.float32, copy=True).sub_(mean_t).div_(255).div_(std_t)',
     ['tests/test_performance.py::test_normalize_in_place_gives_the_formulas_values_and_leaves_its_input']),
    # Issue 60: the benchmark against a plain training loop (--reference), the CPU of a process tree.
    ('src/tools/benchmark.py', '                todo += children.get(pid, [])', '                pass',
     ['tests/test_benchmark.py::test_tree_cpu_adds_up_the_root_and_the_processes_below_it']),
    ('src/tools/benchmark.py', '        legs = REFERENCE_LEGS if round_number % 2 == 0 else REFERENCE_LEGS[::-1]',
     '        legs = REFERENCE_LEGS',
     ['tests/test_benchmark.py::test_the_reference_alternates_the_runs_and_compares_the_best_of_each']),
    ('src/tools/benchmark.py', '        command = [sys.executable, "train_single.py", *flags, "--augment", "--weights", "none",',
     '        command = [sys.executable, "train_single.py", *flags, "--weights", "none",',
     ['tests/test_benchmark.py::test_the_reference_runs_train_single_and_the_plain_loop_on_the_same_images']),
    ('src/tools/plain_loop.py', '                              pin_memory=pinned, drop_last=True)', '                              pin_memory=pinned)',
     ['tests/test_benchmark.py::test_the_reference_runs_train_single_and_the_plain_loop_on_the_same_images']),
    # Ray Train (train_ray.py): each Ray-specific line switched off.
    ('train_ray.py', '    if checkpoint and rank == 0:  # Ray Train restarted', '    if checkpoint and rank == -1:  # Ray Train restarted',
     ['tests/test_ray.py::test_a_lost_worker_costs_only_the_steps_since_the_last_save']),
    ('train_ray.py', 'ray.train.report({"step": state.run_step}, checkpoint=ray.train.Checkpoint.from_directory(folder) if folder else None)',
     'ray.train.report({"step": state.run_step}, checkpoint=None)',
     ['tests/test_ray.py::test_a_lost_worker_costs_only_the_steps_since_the_last_save']),
    ('train_ray.py', 'failure_config=ray.train.FailureConfig(max_failures=args.max_failures)',
     'failure_config=ray.train.FailureConfig(max_failures=0)',
     ['tests/test_ray.py::test_a_lost_worker_costs_only_the_steps_since_the_last_save']),
    ('src/ray_worker.py', '        mark_restarted_by_ray()', '        pass',
     ['tests/test_ray.py::test_a_lost_worker_costs_only_the_steps_since_the_last_save']),
    ('src/ray_worker.py', '    if reported is None or (last_position(here.parent) or (-1, -1)) >= reported:',
     '    if True:',
     ['tests/test_ray.py::test_a_lost_worker_costs_only_the_steps_since_the_last_save']),
    ('train_ray.py', '    with stops_to_workers(control), hangs_end_the_run(control):',
     '    with contextlib.nullcontext(), hangs_end_the_run(control):',
     ['tests/test_ray.py::test_a_stop_on_the_driver_ends_every_worker_at_a_step']),
    ('src/ray_worker.py', '                signals.requested = signals.requested or number', '                pass',
     ['tests/test_ray.py::test_a_stop_on_the_driver_ends_every_worker_at_a_step']),
    ('src/stopping.py', 'PYTHON_DRIVEN = ("train_ray.py",)', 'PYTHON_DRIVEN = ()',
     ['tests/test_ray.py::test_a_stop_on_the_driver_ends_every_worker_at_a_step']),
    ('src/ray_worker.py', '        outcome["exit"] = EXIT_STOPPED', '        outcome["exit"] = 0',
     ['tests/test_ray.py::test_a_worker_ends_on_bad_input_or_a_stop_without_failing_so_ray_does_not_restart_it',
      'tests/test_ray.py::test_a_stop_on_the_driver_ends_every_worker_at_a_step']),
    ('src/ray_worker.py', '            outcome["error"] = one_line(error)', '            pass',
     ['tests/test_ray.py::test_a_worker_ends_on_bad_input_or_a_stop_without_failing_so_ray_does_not_restart_it']),
    # Every worker hears from rank 0 through the process group before Ray's report (a barrier no end of the group reaches).
    ('src/ray_worker.py', '    folder = from_rank_0(lambda: _linked_last(state))',
     '    folder = _linked_last(state) if is_first() else None',
     ['tests/test_ray.py::test_a_save_that_failed_on_rank_0_ends_every_worker_before_rays_report']),
    ('train_ray.py', 'with watch_ranks(joined_store(), args.dist_timeout, device) as heartbeat',
     'with watch_ranks(None, args.dist_timeout, device) as heartbeat',
     ['tests/test_ray.py::test_the_heartbeat_watches_ray_s_process_group_through_its_store']),
    ('train_ray.py', 'with watch_ranks(joined_store(), args.dist_timeout, device) as heartbeat',
     'with watch_ranks(joined_store(), 60, device) as heartbeat',
     ['tests/test_ray.py::test_the_heartbeat_watches_ray_s_process_group_through_its_store']),
    ('train_ray.py', 'torch_config=ray.train.torch.TorchConfig(timeout_s=int(dist_timeout(args.dist_timeout).total_seconds())),',
     'torch_config=ray.train.torch.TorchConfig(),',
     ['tests/test_ray.py::test_the_heartbeat_watches_ray_s_process_group_through_its_store']),
    # A worker that stops answering under Ray: the heartbeat's line is the driver's last, exit 1.
    ('src/ray_worker.py', '    heartbeat.tell = lambda line: ray.get(control.hung.remote(line), timeout=30)',
     '    pass',
     ['tests/test_ray.py::test_a_hung_worker_is_named_and_ends_the_run_in_one_line']),
    ('train_ray.py', '    with stops_to_workers(control), hangs_end_the_run(control):',
     '    with stops_to_workers(control), contextlib.nullcontext():',
     ['tests/test_ray.py::test_a_hung_worker_is_named_and_ends_the_run_in_one_line']),
    ('src/heartbeat.py', '        if tell is not None:\n            tell(line)', '        if tell is not None:\n            pass',
     ['tests/test_ray.py::test_a_hung_worker_is_named_and_ends_the_run_in_one_line']),
    ('src/ray_driver.py', '        print(line, file=sys.stderr, flush=True)\n        raise SystemExit(EXIT_HUNG)',
     '        raise SystemExit(EXIT_HUNG)',
     ['tests/test_ray.py::test_a_hung_worker_is_named_and_ends_the_run_in_one_line']),
    ('src/ray_driver.py', '    return None if head[3] == 4 else f"it answered {head!r}"', '    return None',
     ['tests/test_ray.py::test_an_address_where_another_server_listens_is_one_line_at_once']),
    ('src/ray_driver.py', '            first = None if tls else speaks_grpc(connection)', '            first = None',
     ['tests/test_ray.py::test_an_address_where_another_server_listens_is_one_line_at_once']),
    ('src/ray_driver.py', '    return None if head[3] == 4 else f"it answered {head!r}"', '    return f"it answered {head!r}"',
     ['tests/test_ray.py::test_an_address_where_another_server_listens_is_one_line_at_once']),
    ('src/ray_driver.py', '    use_gpu = resources.get("GPU", 0) > 0', '    use_gpu = False',
     ['tests/test_ray.py::test_more_workers_than_the_cluster_has_is_one_line_before_any_work']),
    ('src/ray_driver.py', '    if not found:', '    if False:',
     ['tests/test_ray.py::test_without_ray_installed_one_line_says_what_to_install']),
    ('src/progress.py', 'disable=not (self.show and self.bars))', 'disable=not self.show)',
     ['tests/test_ray.py::test_ray_trains_what_torchrun_trains_and_rank_0_alone_writes']),
    ('src/cli.py', '    if args.evaluate and ray:', '    if False:',
     ['tests/test_ray.py::test_evaluate_is_left_to_the_scripts_without_a_cluster']),
    # Both sides of the boundaries of check_batches and its neighbours (a blind audit's survivor: the first).
    ('src/loaders.py', 'if len(data.val_idx) < processes:', 'if len(data.val_idx) <= processes:',
     ['tests/test_loaders.py::test_as_many_validation_images_as_processes_are_accepted_and_one_fewer_refused']),
    ('src/devices.py', '    if free < need:\n', '    if free <= need:\n',
     ['tests/test_loaders.py::test_a_dev_shm_with_exactly_what_the_workers_need_is_accepted_and_a_byte_less_refused']),
    ('src/loaders.py', 'if n_val < 1 or n_val >= n:', 'if n_val <= 1 or n_val >= n:',
     ['tests/test_loaders.py::test_a_split_of_one_validation_or_one_training_image_is_accepted_and_none_refused']),
    ('src/loaders.py', 'if n_val < 1 or n_val >= n:', 'if n_val < 1 or n_val > n:',
     ['tests/test_loaders.py::test_a_split_of_one_validation_or_one_training_image_is_accepted_and_none_refused']),

    # What only a GPU runs, run or read on the CPU, and make test-gpu's checks of this round's
    # features (issues 55 and 60): our threads on their rank's GPU, the self-test's code on the CPU.
    ('src/heartbeat.py', '            torch.cuda.set_device(self.device)\n', '',
     ['tests/test_gpu_on_cpu_cuda_paths.py::test_the_heartbeat_thread_sets_its_ranks_gpu_before_it_asks_an_event',
      'gpu:gpu0']),
    ('src/heartbeat.py', '                self.device = torch.device("cuda", torch.cuda.current_device())', '                pass',
     ['tests/test_gpu_on_cpu_cuda_paths.py::test_a_heartbeat_given_cuda_without_an_index_uses_the_main_threads_gpu']),
    ('src/checkpoint_writer.py', '        torch.cuda.set_device(self.device)  # the event', '        pass  #',
     ['tests/test_gpu_on_cpu_cuda_paths.py::test_the_checkpoint_writer_thread_sets_the_gpu_of_its_copies_before_it_waits_for_them']),
    ('src/stopping.py', 'self.hosts = [torch.zeros(1, pin_memory=True) for _ in range(2)] if self.on_gpu else []',
     'self.hosts = [torch.zeros(1) for _ in range(2)] if self.on_gpu else []',
     ['tests/test_gpu_on_cpu_cuda_paths.py::test_the_stop_agreement_under_nccl_reads_each_flag_from_pinned_memory_behind_an_event']),
    ('src/freeze.py', '    if arrived is not None:\n        arrived.synchronize()', '    if False:\n        arrived.synchronize()',
     ['tests/test_gpu_on_cpu_cuda_paths.py::test_the_feature_caches_copy_is_stored_after_its_event']),
    # The three defects that kept make test-gpu from passing on any GPU (issue 55): each fails check 1 on the CPU.
    ('checks/gpu_selftest.py', '    from src.loaders import loader_options\n', '    from src.loaders import loader_options, run_loaders\n',
     ['tests/test_gpu_on_cpu_selftest.py::test_check_1s_pinned_part_builds_what_a_gpu_pins_and_the_writers_file_holds_the_saved_value']),
    ('checks/gpu_selftest.py', '    progress = Progress(args, _bare_state(args, device), batch_images=4, device=device)',
     '    progress = Progress(args, None, 1, 4, device)',
     ['tests/test_gpu_on_cpu_selftest.py::test_check_1s_pinned_part_builds_what_a_gpu_pins_and_the_writers_file_holds_the_saved_value']),
    ('checks/gpu_selftest.py', '    from src.fsdp import fsdp_units\n', '    from src.fsdp import fsdp_units, shard_model\n',
     ['tests/test_gpu_on_cpu_selftest.py::test_check_1s_fsdp_memory_part_shards_as_train_fsdp_does_and_steps_under_each_amp']),
    # The self-test's own logic and hooks.
    ('tests/hooks/sitecustomize.py', '        patcher.at_end(lambda: syncs.write(settings["SYNC_LOG"]) if _trained() else None)',
     '        patcher.at_end(lambda: syncs.write(settings["SYNC_LOG"]))',
     ['tests/test_gpu_selftest_logic.py::test_a_launcher_or_a_fork_server_writes_no_record_under_a_ranks_name']),
    ('tests/hooks/sitecustomize.py', '            _TRAINING["ran"] = True', '            pass',
     ['tests/test_gpu_selftest_logic.py::test_a_launcher_or_a_fork_server_writes_no_record_under_a_ranks_name']),
    ('tests/hooks/sitecustomize.py', '        kind = "soft" if target.is_floating_point() else "hard"', '        kind = "hard"',
     ['tests/test_gpu_selftest_logic.py::test_the_targets_hook_logs_each_kind_of_target_once']),
    ('checks/gpu_selftest.py', '        off = lerp_off(averages[0], params, averages[1], 1 - decay_at(counts[0], 0.9))',
     '        off = lerp_off(averages[0], params, averages[1], 1 - decay_at(counts[0] + 1, 0.9))',
     ['tests/test_gpu_selftest_logic.py::test_the_ema_check_computes_each_steps_average_again_and_catches_another_decay']),
    ('checks/gpu_selftest.py', '                         contexts == [rank], f"{name} rank {rank}"',
     '                         rank in contexts, f"{name} rank {rank}"', ['tests/test_gpu_selftest_logic.py::test_gpu0_needs_each_rank_on_its_own_gpu_alone']),
    ('checks/gpu_selftest.py', '{held / 2**20:.0f} MiB then, allowed {0.05 * held / 2**20:.0f})"), more <= 0.05 * held',
     '{held / 2**20:.0f} MiB then, allowed {0.05 * held / 2**20:.0f})"), more <= held',
     ['tests/test_gpu_selftest_logic.py::test_the_peak_verdict_allows_a_twentieth_of_what_the_rank_held']),
    # This round's features, each caught by its make test-gpu check (and on the CPU where the CPU can show it).
    ('src/checkpoint_writer.py', '            local = self._copy_tensor(value.to_local(), where)',
     '            local = value.to_local().clone()', ['gpu:steps']),
    ('src/sharded_checkpoint.py', '        shards["average"] = average_shards(model, average)', '        pass',
     ['tests/test_gpu_on_cpu_selftest.py::test_every_check_of_make_test_gpu_runs_on_the_cpu_and_passes', 'gpu:steps']),
    ('src/checkpoint_writer.py', '        self.event.record()', '        pass', ['gpu:gpu']),
    ('src/ema.py', '            weight = (1 - decay_at(t, self.decay)) * (1 - skip)',
     '            weight = (1 - decay_at(t + 1, self.decay)) * (1 - skip)', ['tests/test_gpu_on_cpu_selftest.py::test_every_check_of_make_test_gpu_runs_on_the_cpu_and_passes', 'gpu:ema']),
    ('src/tracking.py', 'values = {f"epoch/{key}": value for key, value in numbers(record).items() if key != "epoch"}',
     'values = {f"epoch/{key}": value for key, value in numbers(record).items() if key not in ("epoch", "val_acc")}',
     ['tests/test_gpu_on_cpu_selftest.py::test_every_check_of_make_test_gpu_runs_on_the_cpu_and_passes', 'gpu:track']),
    ('src/batch_norm.py', '        dist.all_reduce(rows)\n', '', ['tests/test_gpu_on_cpu_selftest.py::test_every_check_of_make_test_gpu_runs_on_the_cpu_and_passes', 'gpu:syncbn']),
    ('src/heartbeat.py', '    dump = getattr(c10d, "_dump_nccl_trace" if dist.get_backend() == "nccl" else "_dump_fr_trace", None)',
     '    dump = None', ['tests/test_gpu_on_cpu_selftest.py::test_every_check_of_make_test_gpu_runs_on_the_cpu_and_passes', 'gpu:stop']),
    ('src/dropout.py', '        h = j + -1640531527  # + GOLDEN, mod 2^32', '        h = j + -1640531526  # + GOLDEN, mod 2^32',
     ['tests/test_gpu_on_cpu_selftest.py::test_the_draws_check_compares_tritons_masks_with_the_cpus_in_the_interpreter', 'gpu:draws']),
    ('src/augment.py', '    if not mixers:\n        return None', '    if True:\n        return None', ['tests/test_gpu_on_cpu_selftest.py::test_every_check_of_make_test_gpu_runs_on_the_cpu_and_passes', 'gpu:draws']),
]


def problems(entries: list[tuple]) -> list[str]:
    """Why each malformed entry cannot be applied: its text not found exactly once, a test it
    names that does not exist, and so on."""
    found = []
    for path, original, replacement, tests in entries:
        where = ROOT / path
        if not where.is_file():
            found.append(f"{path}: no such file")
            continue
        text = where.read_text()
        count = text.count(original)
        if count != 1:
            found.append(f"{path}: the original text {original!r} occurs {count} times, not once")
        elif original[:1] in (" ", "\t") and _inside_indent(text, text.index(original)):
            # an indented text found inside a line indented deeper: its replacement breaks the indent
            found.append(f"{path}: the original text {original!r} starts inside a line's indent, not at its start")
        if original == replacement:
            found.append(f"{path}: {original!r} is replaced by itself")
        if not tests or not all(isinstance(test, str) and test.startswith(("tests/", GPU)) for test in tests):
            found.append(f"{path}: {original!r} names no tests, or a test outside tests/: {tests!r}")
            continue
        unknown = [test for test in tests if test.startswith(GPU) and test[len(GPU):] not in gpu_checks()]
        unknown += [test for test in split(tests)[0] if not test_exists(test)]
        if unknown:
            found.append(f"{path}: {original!r} names tests that do not exist: {unknown!r}")
    return found


def _inside_indent(text: str, at: int) -> bool:
    """Whether position `at` of `text` lies inside a line's leading whitespace, past its start."""
    before = text[text.rfind("\n", 0, at) + 1:at]
    return before != "" and before.strip() == ""


def test_exists(test: str) -> bool:
    """Whether a pytest name (tests/test_x.py, or ::test_name, its [parameters] left aside) names a
    test file, and a test function defined in it."""
    path, _, name = test.partition("::")
    file = ROOT / path
    if not file.is_file():
        return False
    name = name.split("[")[0]
    return not name or f"def {name}(" in file.read_text()


def gpu_checks() -> list[str]:
    """The keys of make test-gpu's checks (read from its source: no torch to import)."""
    return re.findall(r'Check\("([a-z0-9-]+)"', (Path(__file__).parent / "gpu_selftest.py").read_text())


def has_gpu() -> bool:
    """Whether this repository's Python sees a CUDA GPU (asked in a process of its own)."""
    probe = subprocess.run([str(PYTHON), "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    return probe.stdout.strip() == "True"


def failed_tests(output: str) -> list[str]:
    """The tests pytest's short summary (-rfE) names as failed or in error, in its order."""
    return [line.split(" ", 1)[1].split(" - ")[0] for line in output.splitlines()
            if line.startswith(("FAILED ", "ERROR ")) and " " in line]


def verdict(outcome: str, failed: list[str]) -> str:
    """The report's word for an entry whose tests ended `outcome` ("passed", "failed", "error" or
    "no GPU") with the tests `failed` failing: caught only when pytest named a failed test (a
    failure it did not name is an error: a crash of the run, not a verdict)."""
    if outcome == "failed" and failed:
        return "caught"
    return {"passed": "SURVIVED", "no GPU": "no GPU"}.get(outcome, "ERROR")


def split(tests: list[str]) -> tuple[list[str], list[str]]:
    """An entry's pytest names, and the keys of its make test-gpu checks."""
    return ([test for test in tests if not test.startswith(GPU)],
            [test[len(GPU):] for test in tests if test.startswith(GPU)])


def scratch_copy() -> Path:
    """The working tree, as git sees it (tracked and untracked-not-ignored files), in a temporary folder."""
    folder = Path(tempfile.mkdtemp(prefix="mutations-"))
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file() or source.is_symlink():  # a tracked file deleted in the tree is skipped
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, folder / name, follow_symlinks=False)
    return folder


class WarmPytest:
    """checks/warm_pytest.py, started once with this repository's .venv: run() runs pytest in a
    fork of it, which has torch, torchvision and pytest imported already (a new `python -m
    pytest` spends seconds on those imports, for every entry)."""

    def __init__(self):
        self.process = subprocess.Popen([str(PYTHON), str(Path(__file__).with_name("warm_pytest.py"))],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=tempfile.gettempdir())
        assert self.process.stdin is not None and self.process.stdout is not None  # both are PIPE
        self.requests, self.answers = self.process.stdin, self.process.stdout
        self.pending = b""

    def _answer(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The server's next line, read from its pipe without a buffer in between (so that the
        wait for it can time out); None when `timeout` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.answers], [], [], left)[0]:
                return None
            chunk = os.read(self.answers.fileno(), 4096)
            if not chunk:
                raise RuntimeError("checks/warm_pytest.py ended: " + self.pending.decode(errors="replace"))
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, cwd: Path, args: list[str], log: Path, env: dict, timeout: float) -> int | None:
        """pytest ARGS in cwd, its output into log: its exit code, None if it ran past `timeout`
        seconds (then its process group is killed)."""
        request = {"cwd": str(cwd), "args": args, "log": str(log), "env": env}
        self.requests.write((json.dumps(request) + "\n").encode())
        self.requests.flush()
        started = self._answer()
        assert started is not None  # waited for without a timeout
        pid = started["pid"]
        answer = self._answer(timeout)
        if answer is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            self._answer()
            return None
        return answer["code"]

    def close(self) -> None:
        self.requests.close()
        self.process.wait()


def _text(captured: bytes | str | None) -> str:
    """What a timed-out subprocess.run captured: bytes whatever its text=True said (as subprocess's
    documentation of TimeoutExpired says), None where it captured nothing."""
    return captured.decode(errors="replace") if isinstance(captured, bytes) else captured or ""


def run_tests(copy: Path, tests: list[str], log: Path, timeout: float,
              server: WarmPytest | None = None) -> tuple[str, float, list[str]]:
    """pytest on `tests` in the copy (in a fork of `server`, else a new Python): ("passed" |
    "failed" | "error", seconds, the tests that failed); its output goes to log."""
    start = time.monotonic()
    basetemp = copy / ".pytest-tmp"  # its own: a session of the shared runs, not another session's folder
    args = ["-q", "-x", "-rfE", "--basetemp", str(basetemp), *tests]
    command = [str(PYTHON), "-m", "pytest", *args]
    if server is not None:
        code = server.run(copy, args, log, {"PYTHONDONTWRITEBYTECODE": "1"}, timeout)
        output = log.read_text(errors="replace") if log.exists() else ""
        if code is None:
            output, code = f"{output}\ntimed out after {timeout:.0f} s", -1
    else:
        try:
            result = subprocess.run(command, cwd=copy, capture_output=True, text=True, timeout=timeout,
                                    env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
            output, code = result.stdout + result.stderr, result.returncode
        except subprocess.TimeoutExpired as expired:
            output, code = f"{_text(expired.stdout)}{_text(expired.stderr)}\ntimed out after {timeout:.0f} s", -1
    log.write_text(" ".join(command) + "\n\n" + output)
    shutil.rmtree(basetemp, ignore_errors=True)
    # pytest's exit codes: 0 all passed, 1 some failed, 2 interrupted or errors in collection, 4 usage, 5 none collected.
    return {0: "passed", 1: "failed"}.get(code, "error"), time.monotonic() - start, failed_tests(output)


def run_gpu_checks(copy: Path, keys: list[str], log: Path, timeout: float) -> tuple[str, float, list[str]]:
    """make test-gpu's checks `keys` in the copy: ("passed" | "failed" | "error", seconds, the
    checks that failed as "gpu:KEY"), failed when its report.json has one of them FAILED; its
    output goes to log."""
    start, failed = time.monotonic(), []
    out = copy / ".gpu-selftest"
    shutil.rmtree(out, ignore_errors=True)
    command = [str(PYTHON), "checks/gpu_selftest.py", "--only", ",".join(keys), "--out", str(out)]
    try:
        result = subprocess.run(command, cwd=copy, capture_output=True, text=True, timeout=timeout)
        output = result.stdout + result.stderr
        report = json.loads((out / "report.json").read_text())
        verdicts = {check["key"]: check["verdict"] for check in report["checks"]}
        failed = [GPU + key for key in keys if verdicts.get(key) == "FAILED"]
        outcome = ("failed" if failed
                   else "passed" if all(verdicts.get(key) == "passed" for key in keys) else "error")
    except subprocess.TimeoutExpired as expired:
        output, outcome = f"{_text(expired.stdout)}{_text(expired.stderr)}\ntimed out after {timeout:.0f} s", "error"
    except (OSError, ValueError, KeyError) as error:
        output, outcome = f"{output}\nno report: {error}", "error"
    log.write_text(" ".join(command) + "\n\n" + output)
    return outcome, time.monotonic() - start, failed


def run_entry(copy: Path, tests: list[str], log: Path, timeout: float, gpu: bool,
              server: WarmPytest | None = None) -> tuple[str, float, list[str]]:
    """The tests of an entry, then (on a GPU) its make test-gpu checks: (outcome, seconds, what
    failed), "failed" as soon as one fails; "no GPU" when it names GPU checks only and there is
    none here."""
    cpu_tests, keys = split(tests)
    outcome, seconds, failed = "passed", 0.0, list[str]()
    if cpu_tests:
        outcome, seconds, failed = run_tests(copy, cpu_tests, log, timeout, server)
    if keys and outcome == "passed":
        if not gpu:
            return ("no GPU" if not cpu_tests else outcome), seconds, failed
        outcome, more, failed = run_gpu_checks(copy, keys, log.with_suffix(".gpu.log"), timeout)
        seconds += more
    return outcome, seconds, failed


def in_parallel(calls: list) -> None:
    """Each call in a thread of its own, all at once; returns when every one has, raising the
    first error one raised."""
    errors = []

    def guarded(call):
        try:
            call()
        except BaseException as error:  # raised below, in the caller's thread
            errors.append(error)
    threads = [threading.Thread(target=guarded, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def baseline(entries: list[tuple], copies: list[Path], servers: list, logs: Path, timeout: float, gpu: bool) -> bool:
    """The named tests on the unchanged copies, their files shared out among the copies and run
    at once (then the named make test-gpu checks, on a GPU): whether all passed (else the log's
    end is printed)."""
    tests, keys = split(sorted({test for _, _, _, named in entries for test in named}))
    files = sorted({test.split("::")[0] for test in tests})
    shares = [[test for test in tests if files.index(test.split("::")[0]) % len(copies) == i] for i in range(len(copies))]
    outcomes: list = [None] * len(copies)

    def share(i: int) -> None:
        outcomes[i] = run_tests(copies[i], shares[i], logs / f"baseline-tests-{i + 1}.log", timeout, servers[i]) \
            if shares[i] else ("passed", 0.0, [])
    in_parallel([lambda i=i: share(i) for i in range(len(copies))])
    results = [(f"baseline-tests-{i + 1}", "tests", len(shares[i]), *outcomes[i]) for i in range(len(copies)) if shares[i]]
    if keys and gpu:
        results.append(("baseline-gpu", "make test-gpu checks", len(keys),
                        *run_gpu_checks(copies[0], keys, logs / "baseline-gpu.log", timeout)))
    for log, kind, count, outcome, seconds, _ in results:
        print(f"baseline: {count} named {kind} on an unchanged copy {outcome} in {seconds:.0f} s", flush=True)
        if outcome != "passed":
            print((logs / f"{log}.log").read_text()[-5000:], file=sys.stderr)
            print(f"the named {kind} fail without any mutation: fix them first (--keep keeps the log)",
                  file=sys.stderr)
            return False
    return True


def short(text: str, width: int = 60) -> str:
    text = text.replace("\n", "\\n").replace("|", "\\|")
    return text if len(text) <= width else text[:width - 3] + "..."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", dest="match", default="",
                        help="only the entries whose path or original text holds this substring")
    parser.add_argument("-t", dest="test", default="",
                        help="only the entries that name a test whose name holds this substring")
    parser.add_argument("--list", action="store_true", help="list the selected entries and stop")
    parser.add_argument("--check", action="store_true",
                        help="check that the selected entries apply (each text found once, each test there) and stop")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the run of the named tests on the unchanged copy")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for one pytest run")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy and the logs")
    parser.add_argument("--gpu", action="store_true", help="only the entries that name checks of make test-gpu")
    parser.add_argument("--sample", type=int, default=0,
                        help="only this many of the selected entries, evenly spread over the list (its time "
                             "estimates the whole list's)")
    parser.add_argument("-j", dest="jobs", type=int, default=2,
                        help="entries run at once, each in a scratch copy of its own (default 2: a 2-core machine)")
    parser.add_argument("--cold", action="store_true",
                        help="start each pytest as a new Python, not as a fork of one that has imported torch")
    args = parser.parse_args()

    entries = [entry for entry in MUTATIONS if (args.match in entry[0] or args.match in entry[1])
               and (not args.test or any(args.test in test for test in entry[3]))
               and (not args.gpu or split(entry[3])[1])]
    if args.sample and args.sample < len(entries):
        entries = [entries[i * len(entries) // args.sample] for i in range(args.sample)]
    if not entries:
        print(f"no entry matches -k {args.match!r}", file=sys.stderr)
        return 2
    bad = problems(entries)
    if bad:
        print("refused, nothing was run; fix these entries of checks/mutations.py:", file=sys.stderr)
        for line in bad:
            print(f"  {line}", file=sys.stderr)
        return 2
    if args.check:
        print(f"{len(entries)} entries apply: each text found once, each named test there")
        return 0
    if args.list:
        for number, (path, original, replacement, tests) in enumerate(entries, 1):
            print(f"{number:3} {path}: {short(original)} -> {short(replacement)}\n      {' '.join(tests)}")
        return 0

    gpu = any(split(entry[3])[1] for entry in entries) and has_gpu()
    jobs = max(1, min(args.jobs, len(entries)))
    copies = [scratch_copy() for _ in range(jobs)]
    logs = copies[0] / ".mutation-logs"
    logs.mkdir()
    servers: list[WarmPytest | None] = [None if args.cold else WarmPytest() for _ in range(jobs)]
    print(f"scratch copies: {' '.join(map(str, copies))}" + ("" if gpu or not any(split(e[3])[1] for e in entries)
                                                            else "; no GPU here: the make test-gpu checks are skipped"),
          flush=True)
    rows: list = [None] * len(entries)
    try:
        if not args.no_baseline and not baseline(entries, copies, servers, logs, args.timeout, gpu):
            return 1
        todo = iter(enumerate(entries, 1))
        lock = threading.Lock()

        def work(copy: Path, server: WarmPytest | None) -> None:
            while True:
                with lock:
                    taken = next(todo, None)
                if taken is None:
                    return
                number, (path, original, replacement, tests) = taken
                target = copy / path
                kept = target.read_text()
                target.write_text(kept.replace(original, replacement, 1))
                try:
                    outcome, seconds, failed = run_entry(copy, tests, logs / f"{number:03}.log", args.timeout, gpu,
                                                         server)
                finally:
                    target.write_text(kept)
                said = verdict(outcome, failed)
                rows[number - 1] = (f"{path}: `{short(original)}` -> `{short(replacement)}`",
                                    ", ".join(test.split("::")[-1] for test in tests), said, seconds)
                with lock:
                    print(f"{number}/{len(entries)} {said:8} {seconds:6.0f} s  {rows[number - 1][0]}", flush=True)
        in_parallel([lambda copy=copy, server=server: work(copy, server) for copy, server in zip(copies, servers)])
    finally:
        for server in servers:
            if server is not None:
                server.close()
        if not args.keep:
            for copy in copies:
                shutil.rmtree(copy, ignore_errors=True)

    print("\n| # | mutation | tests | result | seconds |\n|---|---|---|---|---|")
    for number, (mutation, named, said, seconds) in enumerate(rows, 1):
        print(f"| {number} | {mutation} | {named} | {said} | {seconds:.0f} |")
    caught = sum(said == "caught" for _, _, said, _ in rows)
    skipped = sum(said == "no GPU" for _, _, said, _ in rows)
    print(f"\n{caught} of {len(rows) - skipped} caught" + (f" ({skipped} for a GPU only, not run here)" if skipped else "")
          + "; " + (f"logs in {logs}" if args.keep else "rerun with --keep for the logs"))
    return 0 if caught + skipped == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
