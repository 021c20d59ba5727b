"""Running a trained policy: the deployment contract a checkpoint carries (`contract`), the in-process policy
(`policy.PolicyRunner`) and the websocket server of `python -m hf_vla.serve`."""
