// Unpickler: turns pickle bytes (protocols 0–5) into a pickle::Graph without executing anything.
//
// Byte layout. A pickle is a sequence of opcodes, each one byte followed by its operands, run by
// a stack machine with a mark stack and a memo (index → object); STOP ends it and returns the
// top of the stack. Integers in operands are little-endian unless noted; `text\n` operands are
// ASCII lines ending in LF.
//   0x80 PROTO u8          0x95 FRAME u64 (framing hint, ignored)      '.' STOP
//   '(' MARK  '0' POP  '1' POP_MARK  '2' DUP
//   'N' NONE  0x88 NEWTRUE  0x89 NEWFALSE
//   'J' BININT i32  'K' BININT1 u8  'M' BININT2 u16  0x8a LONG1 u8 n + n bytes  0x8b LONG4 i32 n
//     + n bytes (two's complement, little-endian)  'I' INT text\n ("01"/"00" are True/False)
//     'L' LONG text\n (optional trailing L)
//   'G' BINFLOAT f64 big-endian  'F' FLOAT text\n
//   'X' BINUNICODE u32 n  0x8c SHORT_BINUNICODE u8 n  0x8d BINUNICODE8 u64 n (UTF-8,
//     surrogatepass)  'V' UNICODE raw-unicode-escape text\n
//   'T' BINSTRING i32 n  'U' SHORT_BINSTRING u8 n  'S' STRING quoted repr\n (Python 2 str,
//     decoded as UTF-8 like torch.load's encoding='utf-8')
//   'B' BINBYTES u32 n  'C' SHORT_BINBYTES u8 n  0x8e BINBYTES8 u64 n  0x96 BYTEARRAY8 u64 n
//   ')' EMPTY_TUPLE  0x85/0x86/0x87 TUPLE1/2/3  't' TUPLE (mark)  ']' EMPTY_LIST  'l' LIST (mark)
//   '}' EMPTY_DICT  'd' DICT (mark)  0x8f EMPTY_SET  0x90 ADDITEMS (mark)  0x91 FROZENSET (mark)
//   'a' APPEND  'e' APPENDS (mark)  's' SETITEM  'u' SETITEMS (mark)
//   'p' PUT text\n  'q' BINPUT u8  'r' LONG_BINPUT u32  0x94 MEMOIZE
//   'g' GET text\n  'h' BINGET u8  'j' LONG_BINGET u32
//   'c' GLOBAL module\n name\n  0x93 STACK_GLOBAL  0x82/0x83/0x84 EXT1/2/4 u8/u16/i32
//   'R' REDUCE  0x81 NEWOBJ  0x92 NEWOBJ_EX  'i' INST module\n name\n (mark)  'o' OBJ (mark)
//   'b' BUILD  'P' PERSID text\n  'Q' BINPERSID
//   0x97 NEXT_BUFFER  0x98 READONLY_BUFFER (out-of-band buffers: rejected as kUnsupported)
//
// Errors are kCorrupt (truncation, unknown opcode, stack or mark misuse, bad operand),
// kUnsupported (out-of-band buffers, a protocol above 5, BUILD/APPEND/SETITEM on a node that
// cannot take it) or kOutOfRange (a limit below), and name the input, the opcode and its
// offset: "pickle: data.pkl offset 1234: MARK stack underflow at SETITEMS".
//
// Thread-safety: ReadPickle is reentrant; it touches only its arguments.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/format/pickle_value.h"
#include "core/util/status.h"

namespace ucp::pickle {

// Bounds a hostile pickle cannot push the unpickler past. The defaults admit any pickle
// torch.save or DeepSpeed writes.
struct ReadLimits {
  uint64_t max_nodes = uint64_t{1} << 26;    // Values created
  uint64_t max_stack = uint64_t{1} << 24;    // entries on the value stack
  uint64_t max_marks = uint64_t{1} << 20;    // entries on the mark stack
  uint64_t max_memo = uint64_t{1} << 26;     // memo entries; also bounds memo indices' count
  uint64_t max_payload = uint64_t{1} << 32;  // one str/bytes/int operand, in bytes
  uint32_t max_depth = kMaxDepth;            // container nesting
};

struct ReadOptions {
  // Names the input in error messages, e.g. "mp_rank_00_model_states/data.pkl".
  std::string name = "data.pkl";
  ReadLimits limits;
};

// Parses one pickle (PROTO optional, up to STOP). Bytes after STOP are ignored, as Python
// does. The result's root() is the value STOP returned.
Result<Graph> ReadPickle(std::string_view bytes, const ReadOptions& options = {});

}  // namespace ucp::pickle
