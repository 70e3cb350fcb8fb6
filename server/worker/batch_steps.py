"""How one batch becomes handler calls: what a handler is given for each request, explanations
apart from predictions, a tensor request's rows in chunks, the out-of-memory split and retry, and
one call's failure sorted (answer, split, end the instance) or its outputs made `InferResult`s.

Written once as generators that yield each `HandlerCall` (`worker.handler_calls` drives them, on
the calling thread or awaited). `ModelHost` (`runner.py`) inherits `BatchSteps`; apart from it
because the host keeps the instance's life (load, device, stream, unload) and calls these, while
this module decides what a batch's calls are and what their outcomes become.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from mariner.server.common.archive import ModelArchive
from mariner.server.common.batch_policy import InstanceFailed
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.types import InferRequest, InferResult
from mariner.server.worker.context import Context
from mariner.server.worker.device import Placement, device_error, release_cached_memory
from mariner.server.worker.encoding import encode_output
from mariner.server.worker.failures import Failure, classify, fatal_reason
from mariner.server.worker.handler_calls import HandlerCall, Steps
from mariner.server.worker.handler_errors import (
    bad_output,
    handler_failed,
    out_of_resources,
    prediction_exception,
)
from mariner.server.worker.intermediate import STREAM_NEXT_HEADER, Deliver
from mariner.server.worker.rows import join_rows, split_rows, splittable

log = logging.getLogger("mariner.runner")


def handler_input(req: InferRequest) -> Mapping[str, Any]:
    """What the handler receives for one request, decided by the request's typed `tensors` field.

    A tensor request reaches the handler as {"tensors": {name: ndarray}}, the shape handlers
    that serve the Open Inference Protocol know; any other request hands over its `data` as is.
    The decision never looks inside `data`, so a TorchServe form field named "tensors" stays a
    form field.
    """
    if req.tensors is not None:
        return {"tensors": req.tensors}
    # TorchServe hands binary fields over as bytearray (handlers test for it); text and JSON
    # fields arrive decoded, as there.
    return {k: bytearray(v) if type(v) is bytes else v for k, v in req.data.items()}


class BatchSteps:
    """The batch logic of a `ModelHost`, which sets these attributes (the host's, read here)."""

    id: str
    archive: ModelArchive
    placement: Placement
    max_rows: int
    on_oom: Callable[[], None] | None
    batches: int
    failed: bool
    _handle: Any
    _context: Context | None

    def _batch_steps(
        self, requests: list[InferRequest], deliver: Deliver | None, *, shared: bool
    ) -> Steps[list[InferResult]]:
        explain = [r.headers.get("explain") == "True" for r in requests]
        if any(explain) and not all(explain):
            # TorchServe handlers ask request 0 whether the whole batch explains (BaseHandler's
            # _is_explain): explanations and predictions run as separate handler calls.
            out: list[InferResult | None] = [None] * len(requests)
            for want in (False, True):
                idx = [i for i, e in enumerate(explain) if e is want]
                part = yield from self._batch_steps([requests[i] for i in idx], deliver, shared=shared)
                for i, res in zip(idx, part, strict=True):
                    out[i] = res
            return [r for r in out if r is not None]
        big = [r.tensors is not None and r.items > self.max_rows for r in requests]
        if not any(big):
            return (yield from self._split_steps(requests, deliver, shared))
        results: list[InferResult | None] = [None] * len(requests)
        small = [i for i, b in enumerate(big) if not b]
        if small:
            part = yield from self._split_steps([requests[i] for i in small], deliver, shared)
            for i, res in zip(small, part, strict=True):
                results[i] = res
        for i, b in enumerate(big):
            if b:
                results[i] = yield from self._rows_steps(requests[i], self.max_rows, deliver, shared)
        return [r for r in results if r is not None]

    def _rows_steps(
        self, req: InferRequest, rows: int, deliver: Deliver | None, shared: bool
    ) -> Steps[InferResult]:
        chunks = split_rows(req, rows)
        parts = []
        for c in chunks:
            parts.append((yield from self._split_steps([c], deliver, shared))[0])
        return join_rows(parts, [c.items for c in chunks])

    def _split_steps(
        self, requests: list[InferRequest], deliver: Deliver | None, shared: bool
    ) -> Steps[list[InferResult]]:
        outcome = yield from self._handle_steps(requests, deliver, shared)
        if not isinstance(outcome, Failure):
            return outcome
        # Here the handler's exception and its traceback are gone (PyTorch's FAQ: frames the
        # traceback keeps alive hold the batch's tensors), so emptying the cache frees them.
        release_cached_memory()
        if len(requests) == 1 and not splittable(requests[0]):
            if outcome is Failure.POSSIBLE_OOM:  # the cause is unknown: not "out of memory"
                raise handler_failed(None)
            raise out_of_resources("the model ran out of memory on this request alone; send a smaller input")
        if self.on_oom is not None:
            self.on_oom()
        if len(requests) == 1:
            req = requests[0]
            log.warning("instance %s out of memory on one request of %d rows: retrying in halves",
                        self.id, req.items)  # fmt: skip
            return [(yield from self._rows_steps(req, (req.items + 1) // 2, deliver, shared))]
        mid = len(requests) // 2
        log.warning("instance %s out of memory on a batch of %d: retrying as %d + %d", self.id,
                    len(requests), mid, len(requests) - mid)  # fmt: skip
        first = yield from self._split_steps(requests[:mid], deliver, shared)
        return first + (yield from self._split_steps(requests[mid:], deliver, shared))

    def _handle_steps(
        self, requests: list[InferRequest], deliver: Deliver | None, shared: bool
    ) -> Steps[list[InferResult] | Failure]:
        """The handler's results, or the out-of-memory kind it failed with (returned, not raised,
        so the caller recovers outside the `except` block)."""
        ctx = self._context
        if ctx is None or self._handle is None:
            raise ServingError(Code.UNAVAILABLE, f"model instance {self.id} is not loaded")
        data = [handler_input(req) for req in requests]
        request_ids = [req.request_id for req in requests]
        headers = [req.headers for req in requests]
        if shared:  # one call at a time: the instance's own Context, as handlers that keep it expect
            ctx.begin_batch(request_ids, headers)
            ctx.cl_socket.deliver = deliver
        else:
            ctx = ctx.for_call(request_ids, headers, deliver)
        failure: Failure | None = None
        try:
            outputs = (yield HandlerCall(data, ctx)).unwrap()
        except ServingError:
            raise
        except Exception as exc:
            answer = prediction_exception(exc)
            if answer is not None:  # the handler chose the status and message
                log.warning("handler of %s raised PredictionException (%s) on a batch of %d: %s",
                            self.id, answer.torchserve and answer.torchserve.status, len(data),
                            answer.message[:300])  # fmt: skip
                raise answer from None
            failure = classify(exc)
            reason = fatal_reason(exc) if failure is Failure.FATAL_DEVICE else None
            if failure in (Failure.OTHER, Failure.POSSIBLE_OOM) and self.placement.gpu_id is not None:
                reason = device_error()  # a sticky error the exception's text did not show
            if reason is not None:
                # The device is unusable in this process from now on: end the instance.
                log.error("handler of %s hit a fatal device error (%s); the instance ends and will be "
                          "replaced", self.id, reason, exc_info=exc)  # fmt: skip
                self.failed = True
                raise InstanceFailed(f"fatal device error: {reason}") from None
            if failure is Failure.OTHER:
                log.exception("handler of %s raised for a batch of %d", self.id, len(data))
                raise handler_failed(type(exc).__name__) from None
            log.warning("handler of %s: %s on a batch of %d: %s", self.id, failure.value, len(data),
                        str(exc)[-300:])  # fmt: skip
        except BaseException as exc:  # SystemExit & co: the instance is gone, not just this batch
            log.error(
                "handler of %s ended its instance (%s); it will be replaced", self.id, type(exc).__name__
            )
            self.failed = True
            raise InstanceFailed(f"handler raised {type(exc).__name__}") from None
        finally:
            self.batches += 1
            if shared:
                ctx.cl_socket.deliver = None  # a part sent after the call has no request to go to
        if failure is not None:
            return failure
        if not isinstance(outputs, list) or len(outputs) != len(data):
            error = bad_output(outputs, len(data))
            log.error("handler of %s: %s", self.id, error.message)
            raise error
        results = []
        for i, (req, value) in enumerate(zip(requests, outputs, strict=True)):
            meta = ctx.response_meta(i)
            tensors = value.get("tensors") if req.tensors is not None and isinstance(value, dict) else None
            results.append(
                InferResult(
                    body=b"" if tensors is not None else encode_output(value),
                    tensors=tensors,
                    status=meta.status,
                    phrase=meta.phrase,
                    content_type=meta.headers.get("content-type"),
                    headers={k: v for k, v in meta.headers.items() if k not in _NOT_PASSED_ON},
                    model_version=self.archive.version,
                )
            )
        return results


# Response headers a handler's Context holds that are not passed on as the answer's headers: the
# content type travels apart, and TorchServe's stream marker is the codec's, not the client's.
_NOT_PASSED_ON = frozenset({"content-type", STREAM_NEXT_HEADER})
