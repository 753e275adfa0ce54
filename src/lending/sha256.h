// SHA-256 through OpenSSL's libcrypto (EVP), incremental: the content hash
// of a region's layout entries. Internal (not installed).
//
// Not thread-safe (one object per hash). Move-only.
#pragma once

#include <array>
#include <cstddef>
#include <span>

struct evp_md_ctx_st;  // OpenSSL's EVP_MD_CTX, kept out of the headers that include this one

namespace shoal::lending::detail {

class sha256 {
 public:
  using digest = std::array<std::byte, 32>;

  /// backend_error when libcrypto cannot start a hash (out of memory).
  sha256();
  ~sha256();
  sha256(const sha256&) = delete;
  sha256& operator=(const sha256&) = delete;

  void update(std::span<const std::byte> bytes);
  /// The digest of everything given so far; the object is spent after it.
  [[nodiscard]] digest finish();

 private:
  evp_md_ctx_st* context_;
};

}  // namespace shoal::lending::detail
