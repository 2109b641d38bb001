"""GetTokenizer: a base model's tokenizer files, so that ``get_tokenizer()`` works on a client machine
that has neither the model folder the trainer loaded nor access to the hub."""

from __future__ import annotations

import grpc

from temper.common.errors import from_rpc_error
from temper.v1 import trainer_pb2


class TokenizerVerbs:
    """Mixed into TemperServicer (backends comes from it)."""

    async def GetTokenizer(self, request, context):
        await self.backends.wait_ready()
        # Any trainer of the model will do: they all loaded the same folder or hub id. Not a tenant's
        # object: a model the server offers is offered to every caller (GetServerCapabilities).
        await self.backends.served("trainer", request.base_model)  # NotFound only for a model unknown here
        trainer = next(t for t in self.backends.trainers if t.info.base_model == request.base_model)
        try:
            async for chunk in trainer.stub.ReadTokenizer(trainer_pb2.ReadTokenizerRequest(),
                                                          timeout=trainer.settings.trainer_call_timeout_seconds):
                yield chunk
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
