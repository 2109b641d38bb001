"""gRPC face of the trainer: protobuf in, engine call on the compute thread, protobuf out."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from temper.common.codec import encode_array
from temper.services.trainer.engine import TrainerEngine
from temper.v1 import trainer_pb2, trainer_pb2_grpc


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, engine: TrainerEngine):
        self.engine = engine
        # One compute thread: torch work on the shared model is serialized, the event loop stays free.
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-compute")

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    async def GetModelInfo(self, request, context):
        loaded = self.engine.loaded
        return trainer_pb2.ModelInfo(
            base_model=loaded.name, tokenizer_id=loaded.path, vocab_size=loaded.vocab_size,
            max_context_length=loaded.max_context_length, device=self.engine.settings.device,
            dtype=self.engine.settings.dtype,
        )

    async def CreateAdapter(self, request, context):
        await self._run(self.engine.host.create, request.training_run_id, request.lora_config)
        return trainer_pb2.CreateAdapterResponse()

    async def DropAdapter(self, request, context):
        await self._run(self.engine.host.drop, request.training_run_id)
        return trainer_pb2.DropAdapterResponse()

    async def RunCycle(self, request, context):
        results, steps = await self._run(self.engine.run_cycle, list(request.forward_backward), list(request.optim_step))
        response = trainer_pb2.CycleResponse()
        for result in results:
            out = response.forward_backward.add(loss_fn_output_type="ArrayRecord", metrics=result.metrics)
            for logprobs, loss in zip(result.logprobs, result.elementwise_loss):
                out.loss_fn_outputs.add(
                    fields={"logprobs": encode_array(logprobs, "float32"), "elementwise_loss": encode_array(loss, "float32")}
                )
        for metrics in steps:
            response.optim_step.add(metrics=metrics)
        return response

    async def SaveAdapter(self, request, context):
        size = await self._run(self.engine.save, request.training_run_id, request.checkpoint_key, request.include_optimizer)
        return trainer_pb2.SaveAdapterResponse(size_bytes=size)

    async def LoadAdapter(self, request, context):
        await self._run(self.engine.load, request.training_run_id, request.checkpoint_key, request.with_optimizer)
        return trainer_pb2.LoadAdapterResponse()

    async def ReadCheckpoint(self, request, context):
        for chunk in self.engine.store.read_chunks(request.checkpoint_key, request.weights_only):
            yield chunk


