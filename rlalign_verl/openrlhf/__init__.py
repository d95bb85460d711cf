"""OpenRLHF integration: a launcher around ``openrlhf.cli.train_ppo_ray`` and the per-worker patch.

- :mod:`rlalign_verl.openrlhf.train_ppo_ray`: ``python -m rlalign_verl.openrlhf.train_ppo_ray
  --alignment.regions rope,swiglu,rmsnorm <openrlhf flags>`` strips the plugin's flags, starts Ray with
  a ``worker_process_setup_hook`` and runs OpenRLHF's own ``train_ppo_ray`` unchanged.
- :mod:`rlalign_verl.openrlhf.setup`: ``install()``, run in the driver and in every Ray worker: aligns
  the policy/reference/EMA ``Actor`` models and adds the ``mismatch/*`` metrics.
- :mod:`rlalign_verl.openrlhf.settings`: the settings, their flags and the env vars that carry them.

Import-light: nothing here imports OpenRLHF, torch or Ray at module level.
"""
