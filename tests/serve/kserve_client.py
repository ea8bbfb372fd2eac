"""Runs KServe's Python REST client against a server (in its own process: kserve and tritonclient.grpc both
register `inference.*` protobuf messages, and one process cannot hold both). Prints one JSON line of results.

python tests/serve/kserve_client.py HOST:PORT IMAGE.npy
"""
from __future__ import annotations

import asyncio
import json
import sys

import numpy as np


async def main(url: str, image_path: str) -> dict:
    from kserve import InferInput, InferRequest, InferenceRESTClient, RESTConfig

    image = np.load(image_path)
    base = f"http://{url}"
    client = InferenceRESTClient(RESTConfig(protocol="v2", retries=0, timeout=30))
    try:
        result = {"live": await client.is_server_live(base), "ready": await client.is_server_ready(base),
                  "model_ready": await client.is_model_ready(base, "conv")}
        for mode, binary in (("json", False), ("binary", True)):
            item = InferInput("image", list(image.shape), "FP32")
            item.set_data_from_numpy(image, binary_data=binary)
            response = await client.infer(base, InferRequest("conv", [item], request_id=f"ks-{mode}"),
                                          model_name="conv")
            result[mode] = {"id": response.id, "model_name": response.model_name,
                            "probs": response.outputs[0].as_numpy().tolist(), "shape": response.outputs[0].shape}
        return result
    finally:
        await client.close()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
