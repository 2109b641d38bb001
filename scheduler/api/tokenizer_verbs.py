"""GetTokenizer: a base model's tokenizer files, so that ``get_tokenizer()`` works on a client machine
that has neither the model folder the trainer loaded nor access to the hub."""

from __future__ import annotations

import grpc

from temper.common.errors import NotFound, from_rpc_error
from temper.v1 import trainer_pb2


class TokenizerVerbs:
    """Mixed into TemperServicer (backends comes from it)."""

    async def GetTokenizer(self, request, context):
        await self.backends.wait_ready()
        # Any trainer of the model will do: they all loaded the same folder or hub id. Not a tenant's
        # object: a model the server offers is offered to every caller (GetServerCapabilities).
        trainers = [t for t in self.backends.trainers if t.info.base_model == request.base_model]
        if not trainers:
            raise NotFound(f"no trainer serves base model {request.base_model!r} (GetServerCapabilities lists the models)")
        trainer = trainers[0]
        try:
            async for chunk in trainer.stub.ReadTokenizer(trainer_pb2.ReadTokenizerRequest(),
                                                          timeout=trainer.settings.trainer_call_timeout_seconds):
                yield chunk
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
