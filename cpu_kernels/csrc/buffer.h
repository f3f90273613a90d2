// Scratch buffers the kernels write in full before they read them.

#pragma once

#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// std::vector's allocator, except that a new element of a trivial type is left uninitialised: the kernels' scratch
// buffers (a layer's activations, a matmul's quantised rows) are written in full before they are read, and zeroing
// them first cost a long prefill ~1.4 GB of stores.
template <class T>
struct UninitializedAllocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = UninitializedAllocator<U>;
  };
  UninitializedAllocator() = default;
  template <class U>
  UninitializedAllocator(const UninitializedAllocator<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible<U>::value) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

template <class T>
using Buffer = std::vector<T, UninitializedAllocator<T>>;

}  // namespace
