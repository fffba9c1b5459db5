"""Serving trained runs: ``flarepp serve`` (docs/serve.md).

* :mod:`flarepp.serve.run`: a trained run as the server sees it, the one adapter to the
  prediction API (:func:`~flarepp.serve.run.load_run`);
* :mod:`flarepp.serve.meshes`: a mesh file in, the mesh with its predicted fields out;
* :mod:`flarepp.serve.batching`: concurrent requests batched, large ones streamed;
* :mod:`flarepp.serve.limits`: the request budget and the token;
* :mod:`flarepp.serve.server`: KServe's model server (the Open Inference Protocol, REST and
  gRPC) with the runs as models, the mesh endpoint and the page (needs the ``serve`` extra,
  imported on first use).
"""
