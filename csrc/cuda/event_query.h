// Asking whether an event has passed, without waiting. cudaEventQuery answers
// cudaErrorNotReady for work still queued, and also leaves that answer behind as the
// thread's last error, where the next launch check of torch (or of anyone) takes it for
// a failure of its own launch: event_passed() clears it. Any other answer than success
// or not-ready is a device error, handed to the caller's raise.
//
// Torch-free and CUDA-free: Runtime is CudaExecutor's (the CUDA runtime) or a test's.
// Runtime must provide: a Status type with constants kSuccess and kNotReady,
//   Status query(Event), void clear_last_error().
#pragma once

namespace swa {
namespace cuda {

template <class Runtime, class Event, class Raise>
bool event_passed(Runtime& runtime, Event event, const Raise& raise) {
  const typename Runtime::Status status = runtime.query(event);
  if (status == Runtime::kSuccess) return true;
  runtime.clear_last_error();
  if (status != Runtime::kNotReady) raise(status);
  return false;
}

}  // namespace cuda
}  // namespace swa
