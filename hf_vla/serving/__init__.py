"""Running a trained policy: the deployment contract a checkpoint carries (`contract`), the in-process policy
(`policy.PolicyRunner`), and the websocket server of `python -m hf_vla.serve` by layer: the wire format (`codec`),
the model thread (`batcher`), the server and its sessions (`server`), the recording of what it served (`recorder`).
`hf_vla.serve` is the command."""
