#include "lending/sha256.h"

#include <openssl/evp.h>

#include "shoal/core/error.h"

namespace shoal::lending::detail {

sha256::sha256() : context_(EVP_MD_CTX_new()) {
  if (context_ == nullptr || EVP_DigestInit_ex(context_, EVP_sha256(), nullptr) != 1) {
    EVP_MD_CTX_free(context_);
    throw backend_error("EVP_DigestInit_ex(SHA-256)", "libcrypto could not start a hash");
  }
}

sha256::~sha256() { EVP_MD_CTX_free(context_); }

void sha256::update(std::span<const std::byte> bytes) {
  if (EVP_DigestUpdate(context_, bytes.data(), bytes.size()) != 1) {
    throw backend_error("EVP_DigestUpdate(SHA-256)", "libcrypto refused the bytes");
  }
}

sha256::digest sha256::finish() {
  digest out{};
  unsigned int length = 0;
  if (EVP_DigestFinal_ex(context_, reinterpret_cast<unsigned char*>(out.data()), &length) != 1 ||
      length != out.size()) {
    throw backend_error("EVP_DigestFinal_ex(SHA-256)", "libcrypto gave no 32-byte digest");
  }
  return out;
}

}  // namespace shoal::lending::detail
