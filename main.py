"""Train ResNet-50 on CIFAR-10 on one device, many GPUs or many machines.

python main.py fit                                            # full recipe, configs/default.yaml
python main.py fit --config configs/smoke.yaml                # seconds, synthetic data, CPU
python main.py fit --config configs/ddp.yaml --trainer.devices=4
python main.py fit --config configs/smoke.yaml --ckpt_path last   # start, or resume where it stopped
python main.py test --ckpt_path last
python main.py plan --trainer.devices=4                       # measure every layout of 4 GPUs, pick the fastest
"""

import gc

# The imports create millions of objects and next to no garbage: the collector would sweep them again and again (a
# third of the imports' time, 1.3 of 4.4 CPU-seconds on a 2-core CPU, in every process that runs this file: each
# rank Lightning or torchrun starts, each run ``plan`` measures), so it waits until they are done.
gc.disable()

from pathlib import Path  # noqa: E402

from multigpu.run.host_memory import keep_freed_memory  # noqa: E402

# Here, not under the guard: every process that trains runs it, the ranks Lightning or torchrun start, and those
# DDP-spawn starts and the loader workers, which run this file again as ``__mp_main__``.
keep_freed_memory()

if __name__ == "__main__":
    # Imported here, not above: a loader worker runs this file again (as ``__mp_main__``) and needs only the data
    # modules its fork server preloaded, not the CLI.
    from multigpu.commands import main

    # torch, Lightning and their 3,000 modules are here for the whole run: kept out of the garbage collector's
    # sweeps, during the run and as the interpreter ends, each process (every rank and every planned run) ends
    # about 1 s sooner.
    gc.freeze()
    gc.enable()
    main(default_config_files=[Path(__file__).resolve().parent / "configs" / "default.yaml"])
else:  # a loader worker, or a process DDP-spawn started, importing this file as ``__mp_main__``
    gc.enable()
